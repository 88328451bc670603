"""Decode and verify attention over a row cache, each row read in place up to its own length.

The cache holds C rows of S slots (one [C,S,K,H] pair per layer). Batch row b reads cache row
`rows_B[b]`, whose first `prefix_B[b]` slots hold the keys of positions 0..prefix-1 (a slot
is a RoPE position) and whose next T slots hold the T new tokens, already written. Query t
sees every prefix slot and new token j where `block_mask[b, t, j]` (default causal, j <= t:
a chain; a tree passes its ancestor mask), both only inside a sliding window when one is
given: pos(t) - pos(key) < window, a new token's position being `q_positions[b, j]` (a
tree's tokens sit at prefix + depth, not at their slots).

Two paths compute the same thing:

- "xla" gathers each row's S slots, builds the [B,T,S] mask and runs `blocks.attend_general`:
  the reference (CPU, fp32) and the fallback.
- "pallas" runs one program per (batch row, kv head, block of query rows). It loops over key
  blocks from the row's first slot the window lets any query see to its prefix, loading them
  straight from cache row `rows_B[b]` (no window is copied out of the cache), then the T new
  tokens from slot prefix on, a block at a time, with the block mask (causal: only up to the
  program's last query token); online softmax in fp32. The
  N/K query heads of a kv head share its key loads: the program's query rows are the T x G
  (token, head) pairs of that kv head. When rows x kv heads are too few to fill the GPU,
  several programs share a row's key blocks and their partial sums are merged (flash
  decoding). Rows launch longest first. Triton on GPUs, Pallas' interpreter elsewhere.

A query that sees no key at all (a mask row of all False and an empty prefix) gets the mean of
the values it was shown, as attend_general's uniform row: the XLA path averages all S slots
of the row, the kernel the slots it read; finite either way, and meaningless (callers drop
such rows). With sinks both give 0.

Shape letters: B batch rows, T new tokens a row, N query heads, K kv heads, G = N // K, H head
dim, C cache rows, S slots a row, M = T * G query rows a kv head.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from eagle3kit.core.blocks import attend_general, window_mask
from eagle3kit.core.layers import MASKED

_LOG2E = math.log2(math.e)


@dataclasses.dataclass(frozen=True)
class RaggedBlocks:
    """Tiles (powers of two) and Triton settings: `k` cache slots a loop step, at most `q`
    query rows a program. `split`: programs sharing one row's key blocks (their partial
    sums merged afterwards, as flash decoding), so few rows still fill the GPU; 0 = enough
    for about `programs` programs (two per SM of an H100), at most S / (4 k).
    `interpret`: Pallas' interpreter (any backend)."""

    k: int = 64
    q: int = 64
    split: int = 0
    programs: int = 264
    num_warps: int = 4
    num_stages: int = 2
    interpret: bool = False


def attend_rows(q_BxTxNxH: jax.Array, k_cache_CxSxKxH: jax.Array, v_cache_CxSxKxH: jax.Array,
                rows_B: jax.Array | None, prefix_B: jax.Array, q_positions_BxT: jax.Array, *,
                block_mask_BxTxT: jax.Array | None = None, window: int | jax.Array = 0,
                scale: float, softcap: float = 0.0, sinks_N: jax.Array | None = None,
                impl: str = "xla", blocks: RaggedBlocks | None = None) -> jax.Array:
    """Attention of T new tokens a row over cache row `rows_B[b]` -> [B,T,N,H] in q's dtype.

    q_BxTxNxH         the new tokens' queries (RoPE applied)
    k/v_cache_CxSxKxH one layer's cache; the new tokens' keys are at slots prefix..prefix+T-1
    rows_B            the cache row of each batch row (any subset or order of 0..C-1);
                      None: every row in order (B == C; the XLA path then gathers no rows)
    prefix_B          keys before the new tokens; prefix_B[b] + T <= S
    q_positions_BxT   the new tokens' positions (for windows; prefix_B[b] + t for a chain)
    block_mask_BxTxT  query t sees new token j (None: j <= t)
    window            sliding window (0: none); an int or a traced int32 scalar
    scale, softcap, sinks_N  as blocks.attend_general (sinks: one logit per query head)
    impl              "xla" (reads all S slots of each row: a caller may pass the caches
                      cut to a static bound >= every row's prefix + T) or "pallas" (in
                      place, each row to its own length; interpret mode off GPUs)
    blocks            the kernel's tiles (default RaggedBlocks(); interpret off GPUs)

    The kernel needs S >= 16. It is made for T up to a few hundred (decoding, verifying,
    prefill pieces that read the row); a prompt's first piece (no prefix) is cuDNN's work.
    """
    if impl == "xla":
        return _attend_xla(q_BxTxNxH, k_cache_CxSxKxH, v_cache_CxSxKxH, rows_B, prefix_B,
                           q_positions_BxT, block_mask_BxTxT, window, scale, softcap, sinks_N)
    if impl != "pallas":
        raise ValueError(f"attend_rows: unknown impl {impl!r} (xla or pallas)")
    blocks = blocks or RaggedBlocks(interpret=jax.default_backend() != "gpu")
    return _attend_pallas(q_BxTxNxH, k_cache_CxSxKxH, v_cache_CxSxKxH, rows_B, prefix_B,
                          q_positions_BxT, block_mask_BxTxT, window, scale, softcap, sinks_N,
                          blocks)


def _causal(b: int, t: int) -> jax.Array:
    return jnp.broadcast_to(jnp.tril(jnp.ones((t, t), bool)), (b, t, t))


def _attend_xla(q, k_cache, v_cache, rows, prefix, q_positions, block_mask, window, scale,
                softcap, sinks):
    b, t = q.shape[:2]
    s = k_cache.shape[1]
    block_mask = _causal(b, t) if block_mask is None else block_mask.astype(bool)
    slots = jnp.arange(s)[None, :]
    new = slots - prefix[:, None]  # [B,S]: which new token a slot holds
    is_new = (new >= 0) & (new < t)
    j = jnp.clip(new, 0, t - 1)
    sees_new = jnp.take_along_axis(block_mask, jnp.broadcast_to(j[:, None], (b, t, s)), axis=2)
    mask = jnp.where(is_new[:, None], sees_new, (slots < prefix[:, None])[:, None])
    key_positions = jnp.where(is_new, jnp.take_along_axis(q_positions, j, axis=1), slots)
    mask = window_mask(mask, q_positions, key_positions, jnp.asarray(window, jnp.int32))
    if rows is not None:
        k_cache, v_cache = k_cache[rows], v_cache[rows]
    return attend_general(q, k_cache, v_cache, mask, scale, softcap, sinks)


def _pow2(x: int, least: int = 16) -> int:
    """The smallest power of two >= x and >= least (Triton's dots need 16 rows)."""
    return max(least, 1 << max(0, x - 1).bit_length())


def _div(a, b: int):
    """a // b for a traced non-negative int (Triton lowers `//`'s floor correction poorly)."""
    return jax.lax.div(a, jnp.int32(b))


def _dot(a, b, trans_b: bool = False):
    """[M, K] @ [K, N] (b transposed if asked), fp32 accumulator; fp32 inputs at full
    precision (Triton would otherwise use TF32)."""
    dims = (((1,), (1 if trans_b else 0,)), ((), ()))
    precision = jax.lax.Precision.HIGHEST if a.dtype == jnp.float32 else None
    return jax.lax.dot_general(a, b, dims, precision=precision,
                               preferred_element_type=jnp.float32)


def _kernel(rows_ref, prefix_ref, first_ref, window_ref, q_ref, qpos_ref, mask_ref, kpos_ref,
            sink_ref, k_ref, v_ref, *out_refs, scale: float, softcap: float, block_k: int,
            chunk: int, chunks: int, group: int, causal: bool, slots: int, windowed: bool,
            split: int):
    """One (kv head, batch row, query rows, key split) program; the refs are described in
    `_attend_pallas`."""
    kv_head, part = pl.program_id(0), pl.program_id(3)
    row, prefix = rows_ref[0], prefix_ref[0]
    q = q_ref[...]
    qpos = qpos_ref[...]
    win = window_ref[0] if windowed else None

    def update(carry, keys, values, visible, key_positions):
        acc, m_prev, l_prev = carry
        s = _dot(q, keys, trans_b=True) * scale
        if softcap:
            s = jnp.tanh(s / softcap) * softcap
        if windowed:
            near = (qpos[:, None] - key_positions[None, :]) < win
            visible = visible & (near | (win <= 0))
        s = jnp.where(visible, s * _LOG2E, MASKED)  # base-2 scores
        m = jnp.maximum(m_prev, jnp.max(s, axis=1))
        p = jnp.exp2(s - m[:, None])
        corr = jnp.exp2(m_prev - m)
        acc = acc * corr[:, None] + _dot(p.astype(values.dtype), values)
        return acc, m, l_prev * corr + jnp.sum(p, axis=1)

    def prefix_block(i, carry):
        first = i * block_k
        start = jnp.minimum(first, slots - block_k)  # a cache whose S is no multiple of k
        cols = start + jnp.arange(block_k)
        keys = pl.ds(start, block_k)
        visible = (cols >= first) & (cols < prefix)
        visible = jnp.broadcast_to(visible[None, :], (q.shape[0], block_k))
        return update(carry, k_ref[row, keys, kv_head, :], v_ref[row, keys, kv_head, :],
                      visible, cols)

    rows_q, h = q.shape
    sink = jnp.where(part == 0, sink_ref[...], -jnp.inf)  # -inf, or the sink logit (once)
    init = (jnp.zeros((rows_q, h), jnp.float32), sink,
            jnp.where(sink > -jnp.inf, 1.0, 0.0).astype(jnp.float32))
    lo = _div(first_ref[0], block_k)
    hi = _div(prefix + block_k - 1, block_k)
    if split > 1:  # this program's share of the row's key blocks
        share = _div(jnp.maximum(hi - lo, 0) + split - 1, split)
        lo = lo + part * share
        hi = jnp.minimum(hi, lo + share)
    carry = jax.lax.fori_loop(lo, hi, prefix_block, init)

    # The new tokens, `chunk` at a time from slot prefix (by the last split). A chunk that
    # would run past the cache's end starts earlier; its columns before slot `wanted` were
    # counted already. Mask and key positions are stored after `chunk` zero columns, so the
    # shifted read stays inside them.
    def new_chunk(c, carry):
        wanted = prefix + c * chunk
        start = jnp.minimum(wanted, slots - chunk)
        offset = chunk + c * chunk - (wanted - start)
        keys = pl.ds(start, chunk)
        visible = (mask_ref[:, pl.ds(offset, chunk)] != 0) & (start + jnp.arange(chunk)
                                                             >= wanted)[None, :]
        return update(carry, k_ref[row, keys, kv_head, :], v_ref[row, keys, kv_head, :],
                      visible, kpos_ref[pl.ds(offset, chunk)])

    # Both bounds int32 values on every path: Triton's scf.for needs one type, and a
    # jnp.where of two Python ints lowers to the predicate's i1 (jax's select_n rule).
    last = jnp.int32(chunks)
    if causal:  # no query row of this program sees a token past its own
        last_token = _div((pl.program_id(2) + 1) * rows_q - 1, group)
        last = jnp.minimum(last, _div(last_token, chunk) + 1)
    if split > 1:  # only the last split reads them
        last = last * (part == split - 1).astype(jnp.int32)
    acc, m, l_sum = jax.lax.fori_loop(jnp.int32(0), last, new_chunk, carry)
    if split == 1:
        out_refs[0][...] = (acc / l_sum[:, None]).astype(out_refs[0].dtype)
    else:  # unnormalised, merged by log-sum-exp afterwards
        for ref, x in zip(out_refs, (acc, m, l_sum), strict=True):
            ref[...] = x


def _compiler_params(blocks: RaggedBlocks):
    if blocks.interpret:
        return None
    from jax.experimental.pallas import triton as plgpu  # GPU only
    return plgpu.CompilerParams(num_warps=blocks.num_warps, num_stages=blocks.num_stages)


def _attend_pallas(q, k_cache, v_cache, rows, prefix, q_positions, block_mask, window, scale,
                   softcap, sinks, blocks: RaggedBlocks):
    b, t, n, h = q.shape
    _, s, kh, _ = k_cache.shape
    g = n // kh
    if s < 16 or blocks.k < 16:
        raise ValueError(f"attend_rows: the Pallas kernel needs a cache of at least 16 "
                         f"slots and key blocks of at least 16, got {s} and {blocks.k}")
    block_k = min(blocks.k, 1 << (s.bit_length() - 1))  # a power of two <= S
    chunk = min(_pow2(t), block_k)
    chunks = -(-t // chunk)
    m = t * g
    m_pad = _pow2(m)
    block_q = min(m_pad, blocks.q, max(16, 8192 // h))  # H = 256: a [32, H] fp32 accumulator
    grid = (kh, b, m_pad // block_q)
    split = blocks.split or max(1, min(-(-blocks.programs // math.prod(grid)),
                                       s // (4 * block_k)))
    token_m = jnp.arange(m_pad) // g  # query row -> new token (pad rows: past T)
    real_m = token_m < t
    token_m = jnp.minimum(token_m, t - 1)
    # Longest rows first (kv heads vary fastest in the launch order): no long row is left
    # to run alone at the end.
    order = jnp.argsort(-prefix)
    rows = jnp.arange(b) if rows is None else rows
    q, rows, prefix, q_positions = q[order], rows[order], prefix[order], q_positions[order]

    # Query rows of each kv head: (token, head in the group) pairs, the pad rows zero.
    q_rows = q.astype(k_cache.dtype).reshape(b, t, kh, g, h).transpose(0, 2, 1, 3, 4)
    q_rows = jnp.pad(q_rows.reshape(b, kh, m, h), ((0, 0), (0, 0), (0, m_pad - m), (0, 0)))
    qpos_rows = q_positions.astype(jnp.int32)[:, token_m]  # [B, M]
    causal = block_mask is None
    block_mask = _causal(b, t) if causal else block_mask[order].astype(bool)
    mask_rows = block_mask[:, token_m] & real_m[None, :, None]  # [B, M, T]
    # Mask and key positions after `chunk` zero columns (the kernel's shifted read).
    width = chunk * (chunks + 1)
    mask_rows = jnp.pad(mask_rows.astype(jnp.int32), ((0, 0), (0, 0), (chunk, width - chunk - t)))
    kpos = jnp.pad(q_positions.astype(jnp.int32), ((0, 0), (chunk, width - chunk - t)))
    if sinks is None:
        sink_rows = jnp.full((kh, m_pad), -jnp.inf, jnp.float32)
    else:
        sink_rows = sinks.astype(jnp.float32).reshape(kh, g)[:, jnp.arange(m_pad) % g] * _LOG2E
    windowed = not (isinstance(window, int) and window <= 0)
    window = jnp.asarray(window, jnp.int32).reshape(1)
    first = jnp.zeros((b,), jnp.int32)
    if windowed:  # the first slot any of the row's queries may see
        first = jnp.where(window[0] > 0,
                          jnp.maximum(0, q_positions.min(axis=1).astype(jnp.int32)
                                      - window[0] + 1), 0)

    per_row = pl.BlockSpec((1,), lambda j, i, r, p: (i,))
    cache = pl.BlockSpec(k_cache.shape, lambda j, i, r, p: (0, 0, 0, 0))
    if split == 1:
        out_specs = pl.BlockSpec((None, None, block_q, h), lambda j, i, r, p: (i, j, r, 0))
        out_shape = jax.ShapeDtypeStruct((b, kh, m_pad, h), q.dtype)
    else:
        stat = pl.BlockSpec((None, None, None, block_q), lambda j, i, r, p: (p, i, j, r))
        out_specs = [pl.BlockSpec((None, None, None, block_q, h),
                                  lambda j, i, r, p: (p, i, j, r, 0)), stat, stat]
        out_shape = [jax.ShapeDtypeStruct((split, b, kh, m_pad, h), jnp.float32),
                     *[jax.ShapeDtypeStruct((split, b, kh, m_pad), jnp.float32)] * 2]
    kernel = functools.partial(_kernel, scale=float(scale), softcap=float(softcap),
                               block_k=block_k, chunk=chunk, chunks=chunks, group=g,
                               causal=causal, slots=s, windowed=windowed, split=split)
    out = pl.pallas_call(
        kernel, grid=(*grid, split),
        in_specs=[per_row, per_row, per_row, pl.BlockSpec((1,), lambda j, i, r, p: (0,)),
                  pl.BlockSpec((None, None, block_q, h), lambda j, i, r, p: (i, j, r, 0)),
                  pl.BlockSpec((None, block_q), lambda j, i, r, p: (i, r)),
                  pl.BlockSpec((None, block_q, width), lambda j, i, r, p: (i, r, 0)),
                  pl.BlockSpec((None, width), lambda j, i, r, p: (i, 0)),
                  pl.BlockSpec((None, block_q), lambda j, i, r, p: (j, r)),
                  cache, cache],
        out_specs=out_specs, out_shape=out_shape,
        compiler_params=_compiler_params(blocks), interpret=blocks.interpret,
        name="ragged_attention")(rows.astype(jnp.int32), prefix.astype(jnp.int32), first,
                                 window, q_rows, qpos_rows, mask_rows, kpos, sink_rows,
                                 k_cache, v_cache)
    if split > 1:  # merge the splits' partial sums (m: base-2 maxima)
        acc, m_p, l_p = out
        weight = jnp.exp2(m_p - m_p.max(axis=0))
        out = ((acc * weight[..., None]).sum(0)
               / (l_p * weight).sum(0)[..., None]).astype(q.dtype)
    out = out[:, :, :m].reshape(b, kh, t, g, h).transpose(0, 2, 1, 3, 4)
    return out.reshape(b, t, n, h)[jnp.argsort(order)]
