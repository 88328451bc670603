"""MXFP4 weights (gpt-oss checkpoints) dequantised on load, in numpy.

OCP microscaling FP4: 32 values share one 8-bit power-of-two scale (E8M0, bias 127); each value
is a 4-bit E2M1 number, two per byte, low nibble first. gpt-oss stores an expert weight W as
`W_blocks` [E, rows, cols/32, 16] (uint8) and `W_scales` [E, rows, cols/32] (uint8), rows and
cols being the [out, in] of the matmul; the dequantised tensor is returned as [E, in, out], the
layout of transformers' unquantised `gate_up_proj` / `down_proj` parameters.
"""

from __future__ import annotations

import numpy as np

from eagle3kit.errors import InputError

# E2M1 code -> value (bit 3 is the sign)
FP4_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                       -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], np.float32)
BLOCK = 32


def dequantise(blocks: np.ndarray, scales: np.ndarray, name: str = "", where: object = None
               ) -> np.ndarray:
    """[E, rows, cols/32, 16] uint8 blocks and [E, rows, cols/32] uint8 scales -> float32
    [E, cols, rows]."""
    check(blocks.shape, scales.shape, blocks.dtype, scales.dtype, name, where)
    lo = FP4_VALUES[blocks & 0x0F]
    hi = FP4_VALUES[blocks >> 4]
    values = np.stack([lo, hi], axis=-1).reshape(*blocks.shape[:-1], 2 * blocks.shape[-1])
    values = np.ldexp(values, scales.astype(np.int32)[..., None] - 127)
    e, rows = blocks.shape[:2]
    return np.swapaxes(values.reshape(e, rows, -1), 1, 2)


def check(blocks_shape, scales_shape, blocks_dtype, scales_dtype, name: str, where: object):
    """A layout other than gpt-oss's MXFP4 is a clear error, before anything is read."""
    ok = (len(blocks_shape) == 4 and blocks_shape[-1] == BLOCK // 2
          and tuple(blocks_shape[:-1]) == tuple(scales_shape)
          and np.dtype(blocks_dtype) == np.uint8 and np.dtype(scales_dtype) == np.uint8)
    if not ok:
        raise InputError(
            f"{name}: not an MXFP4 layout this loader understands (expected uint8 blocks "
            f"[E, rows, cols/32, 16] and uint8 E8M0 scales [E, rows, cols/32]; found "
            f"{np.dtype(blocks_dtype)} {tuple(blocks_shape)} and {np.dtype(scales_dtype)} "
            f"{tuple(scales_shape)})", path=where)


def dequantised_shape(blocks_shape) -> tuple[int, ...]:
    e, rows, groups, half = blocks_shape
    return (e, groups * half * 2, rows)


class Mxfp4Source:
    """Wraps a tensor source: every `X_blocks` + `X_scales` pair reads as one float32 `X`."""

    def __init__(self, src, where: object):
        self._src, self._where = src, where
        names = set(src.names)
        self._packed = {n[: -len("_blocks")] for n in names
                        if n.endswith("_blocks") and n[: -len("_blocks")] + "_scales" in names}
        for base in self._packed:
            b, s = src.get(base + "_blocks"), src.get(base + "_scales")
            check(b.shape, s.shape, b.dtype, s.dtype, base, where)
        hidden = {p + suffix for p in self._packed for suffix in ("_blocks", "_scales")}
        self.names = [n for n in src.names if n not in hidden] + sorted(self._packed)
        self.config = src.config

    def shape(self, name: str) -> tuple[int, ...]:
        if name in self._packed:
            return dequantised_shape(self._src.shape(name + "_blocks"))
        return self._src.shape(name)

    def get(self, name: str) -> np.ndarray:
        if name in self._packed:
            return dequantise(self._src.get(name + "_blocks"), self._src.get(name + "_scales"),
                              name, self._where)
        return self._src.get(name)
