"""The EAGLE3 draft head with a KV cache: the training-time-test chain, run for decoding.

The cache is indexed by RoPE position: slot p holds the key/value of the draft entry whose
position is p. With committed tokens x_0..x_n (x_n the target's newest token, not yet run
through the target):

    slots 0..n-1     step-0 entries: column t from (fc(aux_t), embed(x_{t+1})) at position t
    slots n..n+i-1   the chain: drafting step i (1..K-1) at column n-1 reads the previous
                     step's pre-norm h and embed(d_i), at position n-1+i

A query at position p attends to slots 0..p, so drafting step i sees every step-0 key up to
its column plus the chain entries it appended before it, under one softmax: exactly the
"cache hidden" pattern the trainer trains (core/ttt.py), where column t at step k attends to
step 0's keys 0..t and its own keys of steps 1..k, at position t + k. Slots past the query
(chain entries of a previous round, rejected columns, prompt padding) are never read and are
overwritten by the next `extend`.

Shapes: B rows, T new columns, S cache slots, D hidden, A = 3 * target hidden, Vd draft vocab,
K kv heads, H head dim.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from eagle3kit.core import draft, target
from eagle3kit.core.config import DraftConfig
from eagle3kit.core.layers import attend


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class DraftKV:
    """The draft layer's keys and values by position."""

    k: Any  # B,S,K,H (a draft of Y layers: B,S,Y*K,H, decode/parallel_draft.py)
    v: Any  # B,S,K,H

    @staticmethod
    def zeros(cfg: DraftConfig, batch: int, max_len: int, dtype: Any) -> DraftKV:
        shape = (batch, max_len, cfg.num_layers * cfg.num_kv_heads, cfg.head_dim)
        return DraftKV(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype))


def forward_cached(w: draft.DraftWeights, cfg: DraftConfig, embeds_BxTxD: jax.Array,
                   hidden_BxTxD: jax.Array, start: jax.Array, cache: DraftKV
                   ) -> tuple[jax.Array, DraftKV]:
    """T draft columns at positions start..start+T-1 -> (carried h [B,T,D], updated cache).

    `hidden` is fc(aux) for step-0 columns or the previous step's h for a chain step. The new
    keys are written first, so column j of this call sees columns 0..j of it.
    """
    b, t, _ = embeds_BxTxD.shape
    positions = jnp.broadcast_to(start + jnp.arange(t), (b, t))

    def over_cache(p: draft.Projected):
        at = start + jnp.arange(t)  # writes past the cache's end are dropped, never shifted
        k = cache.k.at[:, at].set(p.k_BxTxKxH.astype(cache.k.dtype), mode="drop")
        v = cache.v.at[:, at].set(p.v_BxTxKxH.astype(cache.v.dtype), mode="drop")
        slots = cache.k.shape[1]
        mask = jnp.broadcast_to(jnp.arange(slots)[None, :] <= positions[0][:, None],
                                (b, t, slots))
        dt = p.q_BxTxNxH.dtype
        return attend(p.q_BxTxNxH, k.astype(dt), v.astype(dt), mask), DraftKV(k, v)

    return draft.step(w, cfg, embeds_BxTxD, hidden_BxTxD, positions, over_cache)


def extend(w: draft.DraftWeights, cfg: DraftConfig, target_w: target.TargetWeights,
           aux_BxTxA: jax.Array, next_tokens_BxT: jax.Array, start: jax.Array, cache: DraftKV
           ) -> tuple[jax.Array, DraftKV]:
    """Step-0 entries of committed columns start..start+T-1 -> (h [B,T,D], cache).

    Column t reads the target's captured states at t and the embedding of the token after
    it (`next_tokens[:, j]` = x_{start+j+1}); the h of the last committed column is the
    hidden input of the next drafting chain, and head(h) its first draft token.
    """
    embeds = target.embed_tokens(target_w, next_tokens_BxT)
    return forward_cached(w, cfg, embeds, draft.fuse(w, cfg, aux_BxTxA), start, cache)


def chain_step(w: draft.DraftWeights, cfg: DraftConfig, target_w: target.TargetWeights,
               h_Bx1xD: jax.Array, token_Bx1: jax.Array, position: jax.Array, cache: DraftKV
               ) -> tuple[jax.Array, jax.Array, DraftKV]:
    """One drafting step: the previous h replaces fc(aux) -> (logits [B,1,Vd], h, cache).

    `token` is the previous draft token as a *target* id (the target's embedding reads it).
    """
    embeds = target.embed_tokens(target_w, token_Bx1)
    h, cache = forward_cached(w, cfg, embeds, h_Bx1xD, position, cache)
    return draft.head(w, cfg, h), h, cache
