"""How training reads attention, one typed value: `--attention` (auto, xla, cudnn or pallas)
of `train` and `eval` is checked and resolved here, once a job knows its backend and dtypes,
into the `TrainAttention` that `TTTConfig.attention` holds and the trainer reads (no JAX
imported at module level: a job checks the flag before loading anything). Decoding's own
choice is `decode/kv_attention.py`'s.

xla: the target and every TTT step through XLA (blocks of query rows, core/ttt.py).
cudnn: the target and TTT step 0 through cuDNN's fused flash attention (core/layers.attend).
pallas: the target through cuDNN (XLA off GPUs), every TTT step through the fused kernel of
core/flash.py. auto: on GPUs with a 16-bit target, pallas when the draft computes in 16 bits
too (the kernel was measured and checked on GPUs in bf16 only, docs/benchmarks.md), else
cudnn; xla elsewhere.
"""

from __future__ import annotations

import enum
from typing import Any

from eagle3kit.errors import UserError


class TrainAttention(enum.StrEnum):
    """TTTConfig.attention: equal to its name as a string ("xla", "cudnn", "pallas")."""

    XLA = "xla"
    CUDNN = "cudnn"
    PALLAS = "pallas"

    def target(self, backend: str) -> str:
        """The target forward's attention (`layers.attend`'s impl) on `backend`: "pallas"
        runs the target through cuDNN on GPUs, through XLA elsewhere (where the TTT kernel
        itself runs in Pallas' interpret mode: correct, slow, for tests)."""
        if self is TrainAttention.PALLAS:
            return "cudnn" if backend == "gpu" else "xla"
        return self.value


TRAIN_ATTENTION = tuple(a.value for a in TrainAttention)
CHOICES = ("auto", *TRAIN_ATTENTION)  # --attention's


def check_attention(choice: str) -> None:
    """Refuses an `--attention` that is none of CHOICES (before anything is loaded)."""
    if choice not in CHOICES:
        raise UserError(f"--attention {choice!r}: choose {', '.join(CHOICES)}")


def resolve_attention(choice: str, backend: str, dtype: Any, draft_dtype: Any = None
                      ) -> TrainAttention:
    """`--attention` for a job on `backend` ("gpu", "cpu", ...) with a target computing in
    `dtype` and a draft in `draft_dtype` (None: no draft kernel to consider): `auto`
    resolved as the module docstring says."""
    check_attention(choice)
    if choice != "auto":
        return TrainAttention(choice)
    import jax.numpy as jnp

    def half(d) -> bool:
        return jnp.dtype(d) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))

    if not (half(dtype) and backend == "gpu"):
        return TrainAttention.XLA
    if draft_dtype is not None and half(draft_dtype):
        return TrainAttention.PALLAS
    return TrainAttention.CUDNN
