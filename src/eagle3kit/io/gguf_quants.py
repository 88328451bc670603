"""GGUF dequantisation in JAX: the raw quantised bytes go to the device, float32 comes out.

Each function here is the `gguf` package's numpy `dequantize_blocks` for one type, written in
jnp over the same bytes, so it runs wherever XLA runs (traced inside the loader's programs)
and only the quantised bytes cross from the host.

Bit-exact with the package, on any backend: every product here is of a float16 scale
(11 significant bits) with small integers (a 6-bit scale, at most a 6-bit quant), so it has
at most 24 significant bits and is exact in float32; the one rounding step is the added
minimum (Q4_1, Q5_1, Q4_K, Q5_K), which a fused multiply-add cannot change when the product
is exact. Every value is a multiple of 2^-24 (float16's smallest step), so a backend that
flushes float32 subnormals to zero changes nothing either. Float16 and BF16 bit patterns are
widened by integer ops, so no backend's conversion can differ.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

QK_K = 256

# GGML type ids (gguf.GGMLQuantizationType) -> (values per block, bytes per block)
F32, F16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K, BF16 = 0, 1, 2, 3, 6, 7, 8, 12, 13, 14, 30
BLOCKS = {F32: (1, 4), F16: (1, 2), BF16: (1, 2), Q4_0: (32, 18), Q4_1: (32, 20),
          Q5_0: (32, 22), Q5_1: (32, 24), Q8_0: (32, 34), Q4_K: (QK_K, 144),
          Q5_K: (QK_K, 176), Q6_K: (QK_K, 210)}


def _u16(b: jax.Array) -> jax.Array:
    """Little-endian uint16 from byte pairs [..., 2] (as int32)."""
    b = b.astype(jnp.int32)
    return b[..., 0] | (b[..., 1] << 8)


def _half(b: jax.Array) -> jax.Array:
    """float16 stored in byte pairs [..., 2] -> float32 [...], widened by integer ops as numpy
    widens it (subnormals scaled exactly; inf and NaN payloads kept), so no backend's
    conversion or flush-to-zero mode can change a scale."""
    h = _u16(b)
    sign = lax.bitcast_convert_type((h & 0x8000) << 16, jnp.float32)  # +-0.0
    exp, mant = (h >> 10) & 0x1F, h & 0x3FF
    bits = jnp.where(exp == 0x1F, 0x7F800000 | (mant << 13), ((exp + 112) << 23) | (mant << 13))
    normal = lax.bitcast_convert_type(bits | ((h & 0x8000) << 16), jnp.float32)
    subnormal = jnp.copysign(mant.astype(jnp.float32) * np.float32(2.0**-24), sign)
    return jnp.where(exp == 0, subnormal, normal)


def _nibbles(qs: jax.Array, groups: int, width: int) -> jax.Array:
    """Bytes [n, groups*width] -> [n, groups*2, width]: each group's low nibbles, then high."""
    qs = qs.reshape(qs.shape[0], groups, 1, width) >> jnp.array([0, 4], jnp.uint8)[:, None]
    return (qs & 0x0F).reshape(qs.shape[0], groups * 2, width)


def _q8_0(b):
    d = _half(b[:, 0:2])
    x = lax.bitcast_convert_type(b[:, 2:], jnp.int8).astype(jnp.float32)
    return x * d[:, None]


def _q4_0(b):
    q = _nibbles(b[:, 2:], 1, 16).reshape(b.shape[0], 32).astype(jnp.int8) - 8
    return _half(b[:, 0:2])[:, None] * q.astype(jnp.float32)


def _q4_1(b):
    q = _nibbles(b[:, 4:], 1, 16).reshape(b.shape[0], 32).astype(jnp.float32)
    return _half(b[:, 0:2])[:, None] * q + _half(b[:, 2:4])[:, None]


def _five_bit(b, qh_at: int):
    """Q5_0/Q5_1's 32 quants: low nibbles from the bytes after the 32 high bits at `qh_at`."""
    qh = lax.bitcast_convert_type(b[:, qh_at:qh_at + 4].reshape(-1, 4), jnp.uint32)
    hi = ((qh[:, None] >> jnp.arange(32, dtype=jnp.uint32)) & 1).astype(jnp.uint8)
    lo = _nibbles(b[:, qh_at + 4:], 1, 16).reshape(b.shape[0], 32)
    return lo | (hi << 4)


def _q5_0(b):
    q = _five_bit(b, 2).astype(jnp.int8) - 16
    return _half(b[:, 0:2])[:, None] * q.astype(jnp.float32)


def _q5_1(b):
    q = _five_bit(b, 4).astype(jnp.float32)
    return _half(b[:, 0:2])[:, None] * q + _half(b[:, 2:4])[:, None]


def _scale_min(s):
    """Q4_K/Q5_K's eight 6-bit scales and mins packed in 12 bytes [n, 12] (see gguf's
    Q4_K.get_scale_min)."""
    s = s.reshape(-1, 3, 4)
    d, m, md = s[:, 0], s[:, 1], s[:, 2]
    sc = jnp.concatenate([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mn = jnp.concatenate([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return sc.astype(jnp.float32), mn.astype(jnp.float32)


def _k_affine(b, q):
    """d * scale * q - dmin * min for the eight sub-blocks of 32 quants `q` [n, 8, 32]."""
    sc, mn = _scale_min(b[:, 4:16])
    d = (_half(b[:, 0:2])[:, None] * sc)[..., None]
    dm = (_half(b[:, 2:4])[:, None] * mn)[..., None]
    return (d * q.astype(jnp.float32) - dm).reshape(b.shape[0], QK_K)


def _q4_k(b):
    return _k_affine(b, _nibbles(b[:, 16:144], 4, 32))


def _q5_k(b):
    qh = b[:, 16:48].reshape(-1, 1, 32) >> jnp.arange(8, dtype=jnp.uint8)[:, None]
    return _k_affine(b, _nibbles(b[:, 48:176], 4, 32) | ((qh & 1) << 4))


def _q6_k(b):
    n = b.shape[0]
    ql = _nibbles(b[:, :128], 2, 64).reshape(n, 8, 32)
    qh = b[:, 128:192].reshape(n, 2, 1, 32) >> jnp.array([0, 2, 4, 6], jnp.uint8)[:, None]
    qh = (qh & 0x03).reshape(n, 8, 32)
    q = ((ql | (qh << 4)).astype(jnp.int8) - 32).reshape(n, 16, 16)
    scales = lax.bitcast_convert_type(b[:, 192:208], jnp.int8).astype(jnp.float32)
    d = _half(b[:, 208:210])[:, None] * scales
    return (d[..., None] * q.astype(jnp.float32)).reshape(n, QK_K)


def _bf16(b):
    bits = _u16(b.reshape(-1, 2)).astype(jnp.uint32) << 16
    return lax.bitcast_convert_type(bits, jnp.float32)


_BLOCK_FNS = {Q8_0: _q8_0, Q4_0: _q4_0, Q4_1: _q4_1, Q5_0: _q5_0, Q5_1: _q5_1, Q4_K: _q4_k,
              Q5_K: _q5_k, Q6_K: _q6_k}


def supported(qtype: int) -> bool:
    return qtype in BLOCKS


def dequantize(data: jax.Array, qtype: int, shape: tuple[int, ...]) -> jax.Array:
    """float32 [*shape] from a tensor's stored `data` (io.gguf's GGUFTensor.data: the elements
    of a plain type, else uint8 bytes); traceable."""
    if qtype == F32:
        return data.astype(jnp.float32).reshape(shape)
    if qtype == F16:
        return _half(lax.bitcast_convert_type(data, jnp.uint8)).reshape(shape)
    values, nbytes = BLOCKS[qtype]
    blocks = data.reshape(math.prod(shape) // values, nbytes)
    if qtype == BF16:
        return _bf16(blocks).reshape(shape)
    return _BLOCK_FNS[qtype](blocks).reshape(shape)


# ---- the loader's programs -----------------------------------------------------------------

def fixed(spec: tuple, data):
    """float32 of one tensor from its stored bytes, inside a trace: `spec` is (type, HF shape,
    fix), the fix what `GGUFCheckpoint.get` undoes of llama.cpp's conventions: ("minus_one",)
    for Gemma's norms, ("rotary", heads) for Llama's Q and K, () for none."""
    qtype, shape, fix = spec
    w = dequantize(data, qtype, shape)
    if fix and fix[0] == "minus_one":
        w = w - np.float32(1)
    elif fix and fix[0] == "rotary":
        w = unpermute_rotary(w, fix[1])
    return w


@functools.lru_cache(maxsize=64)
def tensor_program(spec: tuple):
    return jax.jit(functools.partial(fixed, spec))


@functools.lru_cache(maxsize=256)
def weight_program(specs: tuple, transform, cfg, dtype: np.dtype, stacked: bool, sharding):
    """One program per weight, taking the stored bytes of the layers alike (type, shape, fix)
    stacked, one batch each (see `alike`): traced once per batch, not per layer, which keeps
    tracing and compiling short."""
    from jax.sharding import SingleDeviceSharding

    groups = alike(specs)
    order = np.argsort(np.concatenate(list(groups.values())))  # batches' rows -> layers

    def one(data, spec):
        return transform(fixed(spec, data), cfg).astype(dtype)

    def build(*batches):
        if not stacked:
            return one(batches[0][0], specs[0])
        out = [jax.vmap(functools.partial(one, spec=spec))(batch)
               for spec, batch in zip(groups, batches, strict=True)]
        return out[0] if len(out) == 1 else jnp.concatenate(out)[order]

    # on one device of the mesh (then sent to `sharding`): XLA does not split dequantisation
    # by the output's sharding, so a replicated program would dequantise it on every device
    first = SingleDeviceSharding(min(sharding.device_set, key=lambda d: d.id))
    return jax.jit(build, in_shardings=first, out_shardings=first)


@functools.lru_cache(maxsize=256)
def compiled(specs: tuple, transform, cfg, dtype: np.dtype, stacked: bool, sharding,
             shapes: tuple):
    """`weight_program` compiled for its batches' `shapes` (jax.ShapeDtypeStruct); the
    weight it makes is on one device of `sharding`'s."""
    return weight_program(specs, transform, cfg, dtype, stacked, sharding).lower(
        *shapes).compile()


def alike(specs: tuple) -> dict[tuple, list[int]]:
    """Layer indices by spec, in order of first occurrence."""
    groups: dict[tuple, list[int]] = {}
    for i, spec in enumerate(specs):
        groups.setdefault(spec, []).append(i)
    return groups


def unpermute_rotary(w, heads: int):
    """Inverse of llama.cpp's per-head interleaving of the rotary halves (rows of Q/K); numpy
    or jax arrays."""
    half = w.shape[0] // heads // 2
    return w.reshape(heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
