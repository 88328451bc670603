"""What speculative decoding's accepted lengths add up to: tau, per-position acceptance, the
histogram (one summary for `eval`'s batch-1 answers and its batched measurements)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np


def acceptance_summary(accept_lengths: Iterable[Sequence[int]], steps: int) -> dict[str, Any]:
    """Generation acceptance from the accepted draft counts of every verify step, per request.

    A verify step that accepts a draft tokens emits a + 1 (the target's own bonus token
    always counts; the prefill's first token is no verify step and does not). tau is then
    reported both ways the engines do:

        tau_pooled            sum over all verify steps of (a + 1) / number of verify steps
                              (long answers weigh more; what a server's counters report)
        tau_per_request_mean  the mean over requests of each request's own pooled tau
                              (requests without a verify step have none and are left out)

    accept_rate[j-1] is the share of verify steps that accepted draft token j among those
    that accepted tokens 1..j-1 (conditional, like cond_acc), so tau_pooled =
    1 + sum_j prod_{i<=j} accept_rate_i. `tau_generate` is tau_pooled under its older name.
    """
    per_request = [np.asarray(x, np.int64) for x in accept_lengths]
    a = np.concatenate([np.zeros(0, np.int64), *per_request])
    reached = np.asarray([(a >= j - 1).sum() for j in range(1, steps + 1)], np.float64)
    taken = np.asarray([(a >= j).sum() for j in range(1, steps + 1)], np.float64)
    rate = np.where(reached > 0, taken / np.maximum(reached, 1), 0.0)
    pooled = float((a + 1).mean()) if len(a) else 0.0
    taus = [float((r + 1).mean()) for r in per_request if len(r)]
    return {
        "tau_generate": round(pooled, 6),
        "tau_pooled": round(pooled, 6),
        "tau_per_request_mean": round(float(np.mean(taus)), 6) if taus else 0.0,
        "accept_rate": [round(float(r), 6) for r in rate],
        "verify_steps": int(len(a)),
        "accept_histogram": np.bincount(a, minlength=steps + 1).tolist(),
    }
