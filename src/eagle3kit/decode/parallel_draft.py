"""Drafting with a parallel drafter (P-EAGLE, DFlash) in the engine's speculative step: one
draft pass proposes the whole block, the engine's one verify accepts a prefix of it exactly
as it does the EAGLE chain's (decode/speculative.verify_rows), then the next round.

The draft cache (decode/draft_cache.DraftKV) holds every layer's keys and values of the
committed columns, layer y at kv heads y*K .. y*K+K-1, slot = RoPE position. With committed
x_0..x_n (x_n the newest token, its target states not computed yet):

P-EAGLE (core/peagle.py; speculators' and SpecForge's definition: the mask tokens and
`mask_hidden` fill the block after its real first column)

    extend      the depth-0 columns t of every layer, as EAGLE's step-0 entries: column t reads
                aux_t and the draft's own embedding of x_{t+1}, at position t; the carried h
                is the last layer's output of column n-1
    draft       d_1 = head(h of column n-1), the block's real column 0; depths 1..K-1 are
                columns of embed(mask_token_id) and fc(mask_hidden) at positions n..n+K-2,
                written to the cache and attending to every slot up to their own position:
                the committed depth-0 columns up to n-1 and the block's columns before them,
                core/peagle.block_mask's pattern; one pass gives d_2..d_K

DFlash (core/dflash.py; SpecForge's `spec_generate` and SGLang's DFlash worker)

    extend      the context keys and values ctx_t = hidden_norm(fc(aux_t)) of every layer at
                position t, from the target's states of the verified tokens
    draft       the block [x_n, mask, ..., mask] (the target's embedding) at positions
                n..n+L-1 attends to the context slots < n and to the whole block (not
                causal); its slots 1..L-1 propose d_1..d_{L-1}, its keys are not kept

Either way the verify step runs [x_n, d_1..d_K] through the target, and the accepted tokens'
captured states extend the draft cache (the columns after them are never read: a query reads
slots up to its own position, written by then). Proposals are picked independently at each
position (`pick`: the argmax, or a draw from q above temperature 0, which speculative
sampling accepts exactly as a chain's draws).

Shapes: B rows, T columns, S cache slots, Y draft layers, K kv heads (the cache holds Y*K),
H head dim, D draft hidden, A captured width, Vd draft vocab, L block size.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from eagle3kit.core import dflash, draft, peagle, target
from eagle3kit.core.config import DraftConfig
from eagle3kit.core.layers import attend
from eagle3kit.decode.draft_cache import DraftKV
from eagle3kit.decode.sampling import pick

METHODS = ("peagle", "dflash")


def is_parallel(cfg: DraftConfig) -> bool:
    return cfg.method in METHODS


def proposals(cfg: DraftConfig) -> int:
    """Tokens one pass proposes: P-EAGLE's K block columns, DFlash's L - 1 slots after the
    anchor."""
    return cfg.block_size - 1 if cfg.method == "dflash" else cfg.block_size


def check(cfg: DraftConfig, steps: int, topk: int) -> None:
    """Raises ValueError for a drafting shape the block cannot give."""
    if topk != 1:
        raise ValueError(f"a {cfg.arch} draft proposes one block, not a tree (topk {topk})")
    if not 1 <= steps <= proposals(cfg):
        raise ValueError(f"a {cfg.arch} draft of block size {cfg.block_size} proposes "
                         f"{proposals(cfg)} tokens a pass, not {steps}")


def _cached(cache: DraftKV, y: int, q_BxTxNxH, k_BxTxKxH, v_BxTxKxH, start, positions_BxT
            ) -> tuple[jax.Array, DraftKV]:
    """Layer y's keys of T columns written at slots start..start+T-1 (past the end: dropped),
    then attention over its cache up to each column's position."""
    kh = k_BxTxKxH.shape[2]
    heads = slice(y * kh, (y + 1) * kh)
    at = start + jnp.arange(q_BxTxNxH.shape[1])
    k = cache.k.at[:, at, heads].set(k_BxTxKxH.astype(cache.k.dtype), mode="drop")
    v = cache.v.at[:, at, heads].set(v_BxTxKxH.astype(cache.v.dtype), mode="drop")
    mask = jnp.arange(k.shape[1])[None, None, :] <= positions_BxT[:, :, None]
    dt = q_BxTxNxH.dtype
    out = attend(q_BxTxNxH, k[:, :, heads].astype(dt), v[:, :, heads].astype(dt), mask)
    return out, DraftKV(k, v)


def peagle_pass(w: peagle.PEagleWeights, cfg: DraftConfig, embeds_BxTxD, g_BxTxD, start,
                cache: DraftKV) -> tuple[jax.Array, DraftKV]:
    """Every layer over T columns at positions start..start+T-1 -> (last layer's h [B,T,D],
    cache with their keys)."""
    b, t, _ = embeds_BxTxD.shape
    positions = jnp.broadcast_to(start + jnp.arange(t), (b, t))

    def first(p: draft.Projected):
        return _cached(cache, 0, p.q_BxTxNxH, p.k_BxTxKxH, p.v_BxTxKxH, start, positions)

    h, cache = draft.step(w, peagle.head_config(cfg), embeds_BxTxD, g_BxTxD, positions, first)
    for i in range(cfg.num_layers - 1):
        q, k, v = peagle.later_qkv(w, cfg, i, h, positions)
        a, cache = _cached(cache, i + 1, q, k, v, start, positions)
        h = peagle.later_finish(w, cfg, i, h, a)
    return h, cache


def extend(w, cfg: DraftConfig, target_w, aux_BxTxA, next_tokens_BxT, start, cache: DraftKV
           ) -> tuple[jax.Array, DraftKV]:
    """The committed columns start..start+T-1 into the cache -> (h [B,T,D], cache): P-EAGLE's
    depth-0 columns (h: the last layer's output), DFlash's context keys (h: zeros, unread)."""
    if cfg.method == "peagle":
        embeds, g = peagle.block_inputs(w, cfg, next_tokens_BxT, aux_BxTxA,
                                        jnp.ones(next_tokens_BxT.shape, bool))
        return peagle_pass(w, cfg, embeds, g, start, cache)
    b, t = next_tokens_BxT.shape
    ctx = dflash.context(w, cfg, aux_BxTxA)
    positions = jnp.broadcast_to(start + jnp.arange(t), (b, t))
    at = start + jnp.arange(t)
    k, v = cache.k, cache.v
    for y, (ky, vy) in enumerate(dflash.all_context_kv(w, cfg, ctx, positions)):
        heads = slice(y * cfg.num_kv_heads, (y + 1) * cfg.num_kv_heads)
        k = k.at[:, at, heads].set(ky.astype(k.dtype), mode="drop")
        v = v.at[:, at, heads].set(vy.astype(v.dtype), mode="drop")
    return jnp.zeros((b, t, cfg.hidden_size), w.fc.dtype), DraftKV(k, v)


def block_logits(w, cfg: DraftConfig, target_w, vocab, h_1x1xD, x_n, n, cache: DraftKV
                 ) -> tuple[jax.Array, DraftKV]:
    """One row's draft pass -> (logits [proposals, Vd] of d_1.., cache)."""
    if cfg.method == "peagle":
        first = draft.head(w, peagle.head_config(cfg), h_1x1xD)[0]
        if cfg.block_size == 1:
            return first, cache
        shape = (1, cfg.block_size - 1, cfg.hidden_size)
        embeds = jnp.broadcast_to(w.embed[cfg.mask_token_id], shape)
        g = jnp.broadcast_to(draft.fuse(w, cfg, w.mask_hidden.astype(w.fc.dtype)), shape)
        h, cache = peagle_pass(w, cfg, embeds, g, n, cache)
        return jnp.concatenate([first, draft.head(w, peagle.head_config(cfg), h)[0]]), cache
    block = jnp.full((1, cfg.block_size), cfg.mask_token_id, jnp.int32).at[0, 0].set(x_n)
    positions = n + jnp.arange(cfg.block_size)[None]
    kh = cfg.num_kv_heads
    ctx_kv = [(cache.k[:, :, y * kh:(y + 1) * kh], cache.v[:, :, y * kh:(y + 1) * kh])
              for y in range(cfg.num_layers)]
    sees = jnp.broadcast_to(jnp.arange(cache.k.shape[1]) < n, (1, cfg.block_size,
                                                                cache.k.shape[1]))
    embeds = target.embed_tokens(target_w, block).astype(w.fc.dtype)
    h = dflash.forward(w, cfg, embeds, positions, ctx_kv, sees)
    head = dflash.head_weight(w, target_w, vocab.draft_to_target)
    return dflash.head(head, h[:, 1:])[0], cache


def draft_block(w, cfg: DraftConfig, target_w, vocab, h_1x1xD, x_n, n, cache: DraftKV, key,
                steps: int, temperature: float):
    """`steps` proposals of one row's block pass -> (draft indices [steps], their q
    [steps, Vd] or None, cache): decode/speculative.draft_chain's contract."""
    logits, cache = block_logits(w, cfg, target_w, vocab, h_1x1xD, x_n, n, cache)
    keys = jax.random.split(key, steps)
    idx, probs = jax.vmap(lambda lg, k: pick(lg, k, temperature))(logits[:steps], keys)
    return idx, probs, cache
