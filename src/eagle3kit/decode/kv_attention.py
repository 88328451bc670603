"""How decoding reads the KV cache, one typed value: `--kv-attention` (auto, xla or pallas) is
checked and resolved here, once a job knows its devices, into the `KVAttention` that
`EngineConfig.attention` holds and the engine reads (no JAX imported: a job checks the flag
before loading anything).

xla: each step slices the window of every row out of the cache, on any backend and mesh.
pallas: the ragged kernel (decode/ragged_attention.py) reads each row in place up to its own
length, on one device. auto: the kernel on one GPU, where it is the faster of the two
(docs/benchmarks.md), XLA elsewhere.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from typing import Any

from eagle3kit.errors import UserError


class KVAttention(enum.StrEnum):
    """EngineConfig.attention: equal to its name as a string ("xla", "pallas")."""

    XLA = "xla"
    PALLAS = "pallas"


KV_ATTENTION = tuple(a.value for a in KVAttention)  # EngineConfig.attention's choices
CHOICES = ("auto", *KV_ATTENTION)  # --kv-attention's


def auto_kv_attention(devices: Sequence[Any]) -> KVAttention:
    """The KV attention `auto` picks for an engine on `devices`: the ragged kernel on one GPU
    (it reads each row in place up to its own length, where the XLA path copies every row's
    window out of the cache: the faster one there, docs/benchmarks.md), the XLA path
    elsewhere (a CPU, a TPU, and a mesh of several devices, whose cache the kernel cannot read
    on one device)."""
    one_gpu = len(devices) == 1 and devices[0].platform == "gpu"
    return KVAttention.PALLAS if one_gpu else KVAttention.XLA


def check_kv_attention(choice: str) -> None:
    """Refuses a `--kv-attention` that is none of CHOICES (before anything is loaded)."""
    if choice not in CHOICES:
        raise UserError(f"--kv-attention {choice!r}: choose auto, {' or '.join(KV_ATTENTION)}")


def resolve_kv_attention(choice: str, devices: Sequence[Any], hint: str = "run one process "
                         "per GPU") -> KVAttention:
    """`--kv-attention` for an engine on `devices` (a mesh's, flattened): `auto` resolved,
    the kernel refused on several devices (`hint`: what to do instead)."""
    check_kv_attention(choice)
    if choice == KVAttention.PALLAS and len(devices) > 1:
        raise UserError(f"--kv-attention pallas reads the cache on one device, not the "
                        f"{len(devices)} of --mesh: {hint}")
    return auto_kv_attention(devices) if choice == "auto" else KVAttention(choice)
