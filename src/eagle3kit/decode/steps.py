"""The pieces every decoding program of the engine is made of: the rows' state on the device,
fp32 logits, the step loop with its early exit, and a plain step's end (sample, advance).
The engine (decode/engine.py) and its mixed steps (decode/mixed.py) both build on them."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from eagle3kit.core import target
from eagle3kit.decode.sampling import Sampling, is_stop, request_keys, sample


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class RowState:
    """Per cache row (device arrays, [C] each)."""

    token: Any  # int32: the newest token, fed at the next step
    position: Any  # int32: its slot (and RoPE position): where its keys go
    generated: Any  # int32: tokens generated so far
    limit: Any  # int32: max new tokens of the row's request
    seed: Any  # uint32: the request's sampling stream
    active: Any  # bool
    h: Any = None  # speculative: [C,1,D] the draft's h of column position-1

    @staticmethod
    def empty(c: int, draft_hidden: int = 0, dtype: Any = jnp.float32) -> RowState:
        z = jnp.zeros((c,), jnp.int32)
        h = jnp.zeros((c, 1, draft_hidden), dtype) if draft_hidden else None
        return RowState(z, z, z, z, jnp.zeros((c,), jnp.uint32), jnp.zeros((c,), bool), h)


def logits(w: target.LayerList, hidden_BxD: jax.Array) -> jax.Array:
    """fp32 logits: 16-bit logits tie at the top often enough to change greedy answers."""
    return jnp.einsum("bd,dv->bv", hidden_BxD, target.lm_head_weight(w),
                      preferred_element_type=jnp.float32)


def refill_due(waiting, live_at_start, active) -> jax.Array:
    """Whether `waiting` (> 0) rows live at a program's start have finished since: the
    program ends so that the host refills them."""
    return (waiting > 0) & (jnp.sum(live_at_start & ~active) >= waiting)


def run_steps(body, carry: tuple, steps: int, waiting, state_at: int, every: int = 1
              ) -> tuple:
    """`body(i, carry) -> carry` for i = 0, 1, ... while fewer than `steps` ran, a row is still
    live, and fewer than `waiting` rows live at the start have finished (`waiting`: how many
    freed rows the queued requests need before the host refills them, 0 while none waits),
    so no step runs for nothing and freed rows are refilled soon. `carry[state_at]` is the
    rows' state (its `active` [C]); returns (steps run, *carry).

    The condition is checked before every `every` steps (`steps` a multiple of it): on a GPU,
    XLA reads a loop's condition back to the host before each iteration, and the device
    idles while the host then launches the iteration's kernels; the `every` steps between
    two checks are a loop of a fixed count, which runs without that read. Up to `every` - 1
    steps may then run after the program could have ended (finished rows idle in them)."""
    live_at_start = carry[state_at].active

    def more(c):
        active = c[1 + state_at].active
        return (c[0] < steps) & active.any() & ~refill_due(waiting, live_at_start, active)

    def steps_from(c):
        i = c[0]
        if every == 1:
            return (i + 1, *body(i, c[1:]))
        return (i + every,
                *jax.lax.fori_loop(0, every, lambda j, rest: body(i + j, rest), c[1:]))

    return jax.lax.while_loop(more, steps_from, (0, *carry))


def decoded(w, hidden_CxD, s: RowState, out, i, base_key, stop_ids, sampling: Sampling
            ) -> tuple[RowState, jax.Array]:
    """One plain step's end: every live row samples its next token from its newest hidden
    state (written to out[:, i], -1 for idle rows) and advances by it."""
    with jax.named_scope("lm_head"):  # scopes: benchmarks/profile_summary.py
        lg = logits(w, hidden_CxD)
    with jax.named_scope("sampling"):
        token = sample(lg, request_keys(base_key, s.seed, s.generated), sampling)
    with jax.named_scope("bookkeeping"):
        out = out.at[:, i, 0].set(jnp.where(s.active, token, -1))
        live = s.active.astype(jnp.int32)
        generated = s.generated + live
        s = dataclasses.replace(
            s, token=jnp.where(s.active, token, s.token), position=s.position + live,
            generated=generated,
            active=s.active & ~is_stop(token, stop_ids) & (generated < s.limit))
    return s, out
