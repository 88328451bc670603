"""Causal flash attention that returns its log-sum-exp, with a backward pass that takes the
log-sum-exp's cotangent: the fused part of the TTT attention (Pallas; Triton on GPUs,
interpret mode elsewhere).

TTT step k attends to step 0's keys (causal, same document) and k diagonal keys under one
softmax. The kernel computes the first part, out0 = softmax(S) V over step 0's keys, and
lse0 = log sum_s exp(S[t, s]); `ttt._ttt_attend` merges the diagonal scores in by
log-sum-exp algebra. The merge differentiates through lse0, which is why the backward pass
here takes d lse as well as d out. With P = softmax(S), dP = dO V^T and D_t = dO_t . O_t:

    dS[t, s] = P[t, s] (dP[t, s] - D_t) + P[t, s] d lse_t = P[t, s] (dP[t, s] - (D_t - d lse_t))

so the lse cotangent only shifts the row constant D (cuDNN's backward drops it; see
docs/benchmarks.md). Grouped-query attention: query head n reads kv head n // G; dK and dV
are computed per query head in fp32 and summed over each group afterwards.

Shape letters: B batch, T tokens, N query heads, K kv heads, G = N // K, H head dim.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.sharding import PartitionSpec

from eagle3kit.core.layers import MASKED
from eagle3kit.core.sharding import active_mesh, mesh_axis

_LOG2E = math.log2(math.e)


@dataclasses.dataclass(frozen=True)
class FlashBlocks:
    """Tiles (powers of two) and Triton settings. Forward and dQ: `q` query rows per
    program, looping over `k` keys at a time; dK/dV: `bwd_k` keys per program, looping
    over `bwd_q` query rows at a time. `interpret`: Pallas' interpreter (any backend).
    The defaults were the fastest of the tiles tried at the 8B draft's head size and near the
    fastest at SmolLM2's, so one setting serves both (docs/benchmarks.md,
    `benchmarks/ttt_attention.py --blocks`)."""

    q: int = 64
    k: int = 64
    bwd_q: int = 64
    bwd_k: int = 64
    num_warps: int = 4
    num_stages: int = 2
    interpret: bool = False


def _div(a, b: int):
    """a // b for a traced non-negative int: a plain division (Triton lowers `//`'s
    floor correction poorly)."""
    return jax.lax.div(a, jnp.int32(b))


def _dot(a, b, trans_a: bool = False, trans_b: bool = False):
    """[M, K] @ [K, N] (either side transposed) with an fp32 accumulator."""
    dims = (((0 if trans_a else 1,), (1 if trans_b else 0,)), ((), ()))
    return jax.lax.dot_general(a, b, dims, preferred_element_type=jnp.float32)


def _visible(rows, cols, seg_rows, seg_cols):
    """[Q, S] bool: key col visible to query row (causal, same segment)."""
    return (rows[:, None] >= cols[None, :]) & (seg_rows[:, None] == seg_cols[None, :])


def _forward_kernel(q_ref, k_ref, v_ref, seg_q_ref, seg_ref, o_ref, lse_ref, *, scale: float,
                    block_q: int, block_k: int, num_q_blocks: int):
    i = num_q_blocks - 1 - pl.program_id(2)  # longest rows first: a causal grid's tail is short
    q = q_ref[...]
    rows = i * block_q + jnp.arange(block_q)
    seg_q = seg_q_ref[...]
    h = q.shape[-1]

    def body(j, carry):
        acc, m_prev, l_prev = carry
        keys = pl.ds(j * block_k, block_k)
        s = _dot(q, k_ref[keys, :], trans_b=True) * (scale * _LOG2E)  # base-2 scores
        s = jnp.where(_visible(rows, j * block_k + jnp.arange(block_k), seg_q, seg_ref[keys]),
                      s, MASKED)
        m = jnp.maximum(m_prev, jnp.max(s, axis=1))
        p = jnp.exp2(s - m[:, None])
        corr = jnp.exp2(m_prev - m)
        acc = acc * corr[:, None] + _dot(p.astype(v_ref.dtype), v_ref[keys, :])
        return acc, m, l_prev * corr + jnp.sum(p, axis=1)

    init = (jnp.zeros((block_q, h), jnp.float32), jnp.full((block_q,), -jnp.inf, jnp.float32),
            jnp.zeros((block_q,), jnp.float32))
    acc, m, l_sum = jax.lax.fori_loop(0, _div((i + 1) * block_q + block_k - 1, block_k), body,
                                      init)
    o_ref[...] = (acc / l_sum[:, None]).astype(o_ref.dtype)
    lse_ref[...] = (m + jnp.log2(l_sum)) / _LOG2E  # natural log


def _dkdv_kernel(q_ref, k_ref, v_ref, seg_k_ref, seg_ref, do_ref, lse_ref, delta_ref,
                 dk_ref, dv_ref, *, scale: float, block_q: int, block_k: int, num_q_blocks: int):
    j = pl.program_id(2)
    k, v = k_ref[...], v_ref[...]
    cols = j * block_k + jnp.arange(block_k)
    seg_k = seg_k_ref[...]

    def body(i, carry):
        dk, dv = carry
        rows_ = pl.ds(i * block_q, block_q)
        q, do = q_ref[rows_, :], do_ref[rows_, :]
        s = _dot(q, k, trans_b=True) * (scale * _LOG2E)
        s = jnp.where(_visible(i * block_q + jnp.arange(block_q), cols, seg_ref[rows_], seg_k),
                      s, MASKED)
        p = jnp.exp2(s - lse_ref[rows_][:, None] * _LOG2E)  # [Q, S]
        dv = dv + _dot(p.astype(do.dtype), do, trans_a=True)
        dp = _dot(do, v, trans_b=True)
        ds = p * (dp - delta_ref[rows_][:, None])
        return dk + _dot(ds.astype(q.dtype), q, trans_a=True), dv

    zeros = jnp.zeros(k.shape, jnp.float32)
    dk, dv = jax.lax.fori_loop(_div(j * block_k, block_q), num_q_blocks, body, (zeros, zeros))
    dk_ref[...] = (dk * scale).astype(dk_ref.dtype)
    dv_ref[...] = dv.astype(dv_ref.dtype)


def _dq_kernel(q_ref, k_ref, v_ref, seg_q_ref, seg_ref, do_ref, lse_ref, delta_ref, dq_ref, *,
               scale: float, block_q: int, block_k: int, num_q_blocks: int):
    i = num_q_blocks - 1 - pl.program_id(2)
    q, do = q_ref[...], do_ref[...]
    rows = i * block_q + jnp.arange(block_q)
    seg_q = seg_q_ref[...]
    lse2 = lse_ref[...] * _LOG2E
    delta = delta_ref[...]

    def body(j, dq):
        keys = pl.ds(j * block_k, block_k)
        k, v = k_ref[keys, :], v_ref[keys, :]
        s = _dot(q, k, trans_b=True) * (scale * _LOG2E)
        s = jnp.where(_visible(rows, j * block_k + jnp.arange(block_k), seg_q, seg_ref[keys]),
                      s, MASKED)
        p = jnp.exp2(s - lse2[:, None])
        ds = p * (_dot(do, v, trans_b=True) - delta[:, None])
        return dq + _dot(ds.astype(k.dtype), k)

    dq = jax.lax.fori_loop(0, _div((i + 1) * block_q + block_k - 1, block_k), body,
                           jnp.zeros(q.shape, jnp.float32))
    dq_ref[...] = (dq * scale).astype(dq_ref.dtype)


def _compiler_params(blocks: FlashBlocks):
    if blocks.interpret:
        return None
    from jax.experimental.pallas import triton as plgpu  # GPU only
    return plgpu.CompilerParams(num_warps=blocks.num_warps, num_stages=blocks.num_stages)


def _specs(b_q: int, b_k: int, t: int, h: int, g: int, nq: int, reverse: bool):
    """BlockSpecs over grid (N, B, blocks): the program's rows of q-like [B,T,N,H] arrays,
    the whole of k-like [B,T,K,H] ones, the row's [B,T] segment ids (blocked and whole) and
    the [B,N,T] per-row statistics (blocked)."""
    blk = (lambda i: nq - 1 - i) if reverse else (lambda i: i)
    rows = pl.BlockSpec((None, b_q, None, h), lambda n, b, i: (b, blk(i), n, 0))
    whole_q = pl.BlockSpec((None, t, None, h), lambda n, b, i: (b, 0, n, 0))
    whole_kv = pl.BlockSpec((None, t, None, h), lambda n, b, i: (b, 0, _div(n, g), 0))
    kv_rows = pl.BlockSpec((None, b_k, None, h), lambda n, b, i: (b, i, _div(n, g), 0))
    seg_rows = pl.BlockSpec((None, b_q), lambda n, b, i: (b, blk(i)))
    seg_kv_rows = pl.BlockSpec((None, b_k), lambda n, b, i: (b, i))
    seg = pl.BlockSpec((None, t), lambda n, b, i: (b, 0))
    stat_rows = pl.BlockSpec((None, None, b_q), lambda n, b, i: (b, n, blk(i)))
    stat = pl.BlockSpec((None, None, t), lambda n, b, i: (b, n, 0))
    return dict(rows=rows, whole_q=whole_q, whole_kv=whole_kv, kv_rows=kv_rows,
                seg_rows=seg_rows, seg_kv_rows=seg_kv_rows, seg=seg, stat_rows=stat_rows,
                stat=stat)


def _forward(q, k, v, seg, blocks: FlashBlocks):
    b, t, n, h = q.shape
    g = n // k.shape[2]
    nq = t // blocks.q
    sp = _specs(blocks.q, blocks.k, t, h, g, nq, reverse=True)
    kernel = functools.partial(_forward_kernel, scale=h ** -0.5, block_q=blocks.q,
                               block_k=blocks.k, num_q_blocks=nq)
    return pl.pallas_call(
        kernel, grid=(n, b, nq),
        in_specs=[sp["rows"], sp["whole_kv"], sp["whole_kv"], sp["seg_rows"], sp["seg"]],
        out_specs=[sp["rows"], sp["stat_rows"]],
        out_shape=[jax.ShapeDtypeStruct(q.shape, q.dtype),
                   jax.ShapeDtypeStruct((b, n, t), jnp.float32)],
        compiler_params=_compiler_params(blocks), interpret=blocks.interpret,
        name="ttt_flash_forward")(q, k, v, seg, seg)


def _backward(q, k, v, seg, o, lse, do, dlse, blocks: FlashBlocks):
    b, t, n, h = q.shape
    kh = k.shape[2]
    g = n // kh
    # The row constant of dS, with the lse cotangent folded in (the module docstring).
    delta = jnp.einsum("btnh,btnh->bnt", o.astype(jnp.float32), do.astype(jnp.float32)) - dlse
    do = do.astype(q.dtype)
    nk = t // blocks.bwd_k
    sp = _specs(blocks.bwd_q, blocks.bwd_k, t, h, g, t // blocks.bwd_q, reverse=False)
    per_head = jax.ShapeDtypeStruct((b, t, n, h), jnp.float32 if g > 1 else k.dtype)
    kv_out = pl.BlockSpec((None, blocks.bwd_k, None, h), lambda n_, b_, i: (b_, i, n_, 0))
    dk, dv = pl.pallas_call(
        functools.partial(_dkdv_kernel, scale=h ** -0.5, block_q=blocks.bwd_q,
                          block_k=blocks.bwd_k, num_q_blocks=t // blocks.bwd_q),
        grid=(n, b, nk),
        in_specs=[sp["whole_q"], sp["kv_rows"], sp["kv_rows"], sp["seg_kv_rows"], sp["seg"],
                  sp["whole_q"], sp["stat"], sp["stat"]],
        out_specs=[kv_out, kv_out], out_shape=[per_head, per_head],
        compiler_params=_compiler_params(blocks), interpret=blocks.interpret,
        name="ttt_flash_dkdv")(q, k, v, seg, seg, do, lse, delta)
    if g > 1:  # each kv head's gradient is the sum over the query heads of its group
        dk, dv = (x.reshape(b, t, kh, g, h).sum(3).astype(k.dtype) for x in (dk, dv))
    nq = t // blocks.q
    sp = _specs(blocks.q, blocks.k, t, h, g, nq, reverse=True)
    dq = pl.pallas_call(
        functools.partial(_dq_kernel, scale=h ** -0.5, block_q=blocks.q, block_k=blocks.k,
                          num_q_blocks=nq),
        grid=(n, b, nq),
        in_specs=[sp["rows"], sp["whole_kv"], sp["whole_kv"], sp["seg_rows"], sp["seg"],
                  sp["rows"], sp["stat_rows"], sp["stat_rows"]],
        out_specs=sp["rows"], out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        compiler_params=_compiler_params(blocks), interpret=blocks.interpret,
        name="ttt_flash_dq")(q, k, v, seg, seg, do, lse, delta)
    return dq, dk, dv


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _flash(q, k, v, seg, blocks):
    return tuple(_forward(q, k, v, seg, blocks))


def _flash_fwd(q, k, v, seg, blocks):
    o, lse = _forward(q, k, v, seg, blocks)
    return (o, lse), (q, k, v, seg, o, lse)


def _flash_bwd(blocks, res, cts):
    q, k, v, seg, o, lse = res
    do, dlse = cts
    return (*_backward(q, k, v, seg, o, lse, do, dlse, blocks), None)


_flash.defvjp(_flash_fwd, _flash_bwd)


def flash_attention(q_BxTxNxH: jax.Array, k_BxTxKxH: jax.Array, v_BxTxKxH: jax.Array,
                    segment_ids_BxT: jax.Array, blocks: FlashBlocks | None = None
                    ) -> tuple[jax.Array, jax.Array]:
    """Causal attention within documents -> (out [B, T, N, H] in q's dtype, lse [B, N, T]
    fp32, the natural log-sum-exp of each row's scaled scores q.k / sqrt(H)).

    Key s is visible to query t when s <= t and both carry the same segment id (padding
    attends to padding: every row sees its own key, so no row is empty). Differentiable in
    q, k, v through both outputs. Off GPUs the kernels run in Pallas' interpret mode (slow:
    tests only). T is padded to a multiple of the tiles with keys no real row can see.
    Under a mesh (`use_mesh`) each device runs the kernel on its own rows (`shard_map` over
    the batch axis): XLA cannot partition a kernel call itself.
    """
    blocks = blocks or FlashBlocks(interpret=jax.default_backend() != "gpu")
    mesh = active_mesh()
    if mesh is None or mesh.size == 1:
        return _padded(q_BxTxNxH, k_BxTxKxH, v_BxTxKxH, segment_ids_BxT, blocks)
    axis = mesh_axis("batch")
    if axis is not None and q_BxTxNxH.shape[0] % mesh.shape[axis]:
        axis = None  # an odd batch stays replicated
    rows, stats = PartitionSpec(axis), PartitionSpec(axis, None, None)
    return jax.shard_map(functools.partial(_padded, blocks=blocks), mesh=mesh,
                         in_specs=(rows, rows, rows, rows), out_specs=(rows, stats),
                         check_vma=False)(q_BxTxNxH, k_BxTxKxH, v_BxTxKxH, segment_ids_BxT)


def _padded(q_BxTxNxH, k_BxTxKxH, v_BxTxKxH, segment_ids_BxT, blocks: FlashBlocks):
    """The kernel on T padded to a multiple of the tiles, the outputs cut back to T."""
    t = q_BxTxNxH.shape[1]
    tile = max(blocks.q, blocks.k, blocks.bwd_q, blocks.bwd_k)
    pad = -t % tile
    if pad:
        widths = [(0, 0), (0, pad), (0, 0), (0, 0)]
        q_BxTxNxH, k_BxTxKxH, v_BxTxKxH = (jnp.pad(x, widths)
                                           for x in (q_BxTxNxH, k_BxTxKxH, v_BxTxKxH))
        segment_ids_BxT = jnp.pad(segment_ids_BxT, [(0, 0), (0, pad)], constant_values=-1)
    o, lse = _flash(q_BxTxNxH, k_BxTxKxH, v_BxTxKxH, segment_ids_BxT.astype(jnp.int32), blocks)
    return o[:, :t], lse[:, :, :t]
