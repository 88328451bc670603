"""x @ w for a few rows of x: a decoding step's matmuls, bound by reading w.

At M <= 64 rows a [M, K] x [K, N] product does 2M FLOPs per weight it reads, far below what
a GPU's bandwidth feeds its tensor cores, so its time is w's bytes over the bandwidth. The
kernel streams w once: each program owns `block_n` output columns and a 1/split share of K,
walks its share in `block_k` steps (the loads pipelined `num_stages` deep) and accumulates
in fp32; the splits' partial sums are added afterwards. Triton on GPUs, Pallas' interpreter
elsewhere (the CPU tests). A decode step on one GPU (`row_cache.forward_rows`, matmul_impl
"pallas") runs q|k|v, o_proj and the MLP's down projection through it where it `pays`:
`MIN_ROWS` to `MAX_ROWS` rows and weights of `MIN_BYTES` or more (an 8B target's, not SmolLM2's);
benchmarks/decode_matmuls.py times it against XLA's matmuls.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

# Rows the kernel takes: where it beat XLA's matmuls on the 8B decode step; at fewer rows
# XLA's were as fast or faster (docs/benchmarks.md)
MIN_ROWS, MAX_ROWS = 17, 64
MIN_BYTES = 16 << 20  # smaller weights, XLA's (measured on an 8B's 32-235 MB matrices only)


@dataclasses.dataclass(frozen=True)
class SkinnyBlocks:
    block_n: int = 64
    block_k: int = 64
    split: int = 0  # K split among programs; 0: enough programs to fill `programs`
    programs: int = 264  # two per SM of an H100
    num_warps: int = 4
    num_stages: int = 4
    interpret: bool = False


def _kernel(x_ref, w_ref, o_ref, *, block_k: int, steps: int):
    def body(i, acc):
        ks = pl.ds(pl.multiple_of(i * block_k, block_k), block_k)
        return acc + jnp.dot(x_ref[:, ks], w_ref[ks, :], preferred_element_type=jnp.float32)

    acc = jax.lax.fori_loop(0, steps, body, jnp.zeros(o_ref.shape, jnp.float32))
    o_ref[...] = acc.astype(o_ref.dtype)


def skinny_matmul(x_MxK: jax.Array, w_KxN: jax.Array,
                  blocks: SkinnyBlocks | None = None) -> jax.Array:
    """[M, K] x [K, N] -> [M, N] in x's dtype, fp32 accumulation. K must be a multiple of
    block_k * split and N of block_n (the caller falls back to XLA otherwise: `fits`)."""
    blocks = blocks or SkinnyBlocks(interpret=jax.default_backend() != "gpu")
    m, k = x_MxK.shape
    n = w_KxN.shape[1]
    # Triton's tiles are powers of two, and its dots at least 16 rows
    m_pad = max(16, 1 << (m - 1).bit_length())
    x = jnp.pad(x_MxK.astype(w_KxN.dtype), ((0, m_pad - m), (0, 0)))
    columns = n // blocks.block_n
    split = blocks.split or _split(k, blocks, columns)
    part = k // split
    kernel = functools.partial(_kernel, block_k=blocks.block_k, steps=part // blocks.block_k)
    params = None
    if not blocks.interpret:
        from jax.experimental.pallas import triton as plgpu  # GPU only
        params = plgpu.CompilerParams(num_warps=blocks.num_warps, num_stages=blocks.num_stages)
    out = pl.pallas_call(
        kernel, grid=(columns, split),
        in_specs=[pl.BlockSpec((m_pad, part), lambda j, p: (0, p)),
                  pl.BlockSpec((part, blocks.block_n), lambda j, p: (p, j))],
        out_specs=pl.BlockSpec((None, m_pad, blocks.block_n), lambda j, p: (p, 0, j)),
        out_shape=jax.ShapeDtypeStruct((split, m_pad, n), jnp.float32),
        compiler_params=params, interpret=blocks.interpret, name="skinny_matmul")(x, w_KxN)
    return out.sum(axis=0)[:m].astype(x_MxK.dtype)


def _split(k: int, blocks: SkinnyBlocks, columns: int) -> int:
    """The largest power-of-two split of K, up to what fills `programs`, that keeps whole
    block_k steps."""
    split = 1
    while (columns * split * 2 <= blocks.programs and k % (2 * split * blocks.block_k) == 0):
        split *= 2
    return split


def fits(k: int, n: int, blocks: SkinnyBlocks) -> bool:
    return k % blocks.block_k == 0 and n % blocks.block_n == 0


def pays(rows: int, w_KxN: jax.Array, blocks: SkinnyBlocks) -> bool:
    """Whether x @ w of `rows` rows goes through the kernel: a few rows, a weight large enough
    to be bound by its reads, tiles that divide it."""
    return (MIN_ROWS <= rows <= MAX_ROWS and w_KxN.size * w_KxN.dtype.itemsize >= MIN_BYTES
            and fits(*w_KxN.shape, blocks))
