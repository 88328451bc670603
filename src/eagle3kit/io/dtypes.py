"""Floating-point dtypes by name: one table for every command (train, eval, convert)."""

from __future__ import annotations

import ml_dtypes
import numpy as np

from eagle3kit.errors import InputError

DTYPES: dict[str, np.dtype] = {
    "bfloat16": np.dtype(ml_dtypes.bfloat16), "float16": np.dtype(np.float16),
    "float32": np.dtype(np.float32),
}
ALIASES = {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp32": "float32",
           "float": "float32"}
COMPUTE = ("bfloat16", "float32")  # what train and eval compute in (float16 overflows)


def dtype_name(name: str, choices: tuple[str, ...] = tuple(DTYPES),
               option: str = "--dtype") -> str:
    """Canonical name (`bf16` -> `bfloat16`) among `choices`; anything else is an InputError."""
    canon = ALIASES.get(name, name)
    if canon not in choices:
        raise InputError(f"{option} {name!r}: choose {', '.join(choices)}")
    return canon
