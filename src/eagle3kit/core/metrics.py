"""Acceptance metrics of a TTT rollout: one implementation for `train` and `eval`.

Per TTT step k (0-based), over *masked tokens* (assistant tokens inside their own document
whose step-k target exists; never B*T as SpecJAX counts):

    acc_k       share of masked positions where the draft's argmax, mapped to a target id,
                equals the target's argmax (a target argmax outside the draft vocab counts
                as a miss: the engine would reject that token too)
    cond_acc_k  the same, among positions whose steps 0..k-1 were all right
    tau         expected acceptance length of a K-token chain, 1 + sum_k prod_{j<=k} cond_acc_j

The device side only sums counts (`StepCounts`), so counts from micro-batches, devices,
hosts and evaluation batches add up exactly before the ratios are taken.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from eagle3kit.core.sharding import to_host


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class StepCounts:
    """Sums over tokens, one entry per TTT step [K]."""

    total: Any  # masked positions
    correct: Any  # ... where the draft's argmax is the target's
    cond_total: Any  # masked positions whose previous steps were all right
    cond_correct: Any  # ... and this step is right too
    ce_sum: Any  # summed soft cross-entropy over positions trained on, whatever `--loss` is

    @staticmethod
    def zeros(steps: int) -> StepCounts:
        z = jnp.zeros((steps,), jnp.float32)
        return StepCounts(z, z, z, z, z)

    def __add__(self, other: StepCounts) -> StepCounts:
        return jax.tree.map(lambda a, b: a + b, self, other)


def step_counts(valid_k: list[jax.Array], correct_k: list[jax.Array],
                ce_k: list[jax.Array]) -> StepCounts:
    """Counts from per-step [B, T] masks: `valid` (masked positions), `correct`
    (valid and right), `ce` (per-position loss already multiplied by its training mask)."""
    total, correct, cond_total, cond_correct, ce_sum = [], [], [], [], []
    chain = None  # all previous steps right at this column
    for valid, ok, ce in zip(valid_k, correct_k, ce_k, strict=True):
        valid, ok = valid.astype(jnp.float32), ok.astype(jnp.float32)
        prev = jnp.ones_like(valid) if chain is None else chain
        total.append(valid.sum())
        correct.append(ok.sum())
        cond_total.append((valid * prev).sum())
        cond_correct.append((ok * prev).sum())
        ce_sum.append(ce.sum())
        chain = prev * ok
    return StepCounts(*(jnp.stack(x) for x in (total, correct, cond_total, cond_correct,
                                                 ce_sum)))


def summarize(counts: StepCounts) -> dict[str, Any]:
    """Host-side ratios: acc, cond_acc (lists over steps), tau, masked token count."""
    c = jax.tree.map(lambda x: np.asarray(x, np.float64), to_host(counts))
    acc = np.where(c.total > 0, c.correct / np.maximum(c.total, 1), 0.0)
    cond = np.where(c.cond_total > 0, c.cond_correct / np.maximum(c.cond_total, 1), 0.0)
    return {
        "acc": [round(float(a), 6) for a in acc],
        "cond_acc": [round(float(a), 6) for a in cond],
        "tau": round(expected_acceptance_length(cond), 6),
        "ce": [round(float(x), 6) for x in c.ce_sum / np.maximum(c.total, 1)],
        "masked_tokens": int(c.total[0]),
    }


def expected_acceptance_length(cond_acc) -> float:
    """tau = 1 + sum_k prod_{j<=k} cond_acc_j (the bonus token counts as one)."""
    return float(1.0 + np.cumprod(np.asarray(cond_acc, np.float64)).sum())
