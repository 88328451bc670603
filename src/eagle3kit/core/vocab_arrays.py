"""The draft vocabulary on the device, as training (`core/ttt.py`) and decoding (`decode/`)
read it: its own module so that a decoder needs nothing of the training code, and apart from
`core/vocab.py`, which stays numpy-only for the commands that read a vocabulary without JAX."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from eagle3kit.core.vocab import VocabMap


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class VocabArrays:
    """Device copies of the vocab map."""

    draft_to_target: Any  # Vd int32: target id of each draft id (i + d2t[i])
    t2d: Any  # V bool

    @staticmethod
    def from_map(vocab: VocabMap) -> VocabArrays:
        return VocabArrays(jnp.asarray(vocab.used_ids, jnp.int32), jnp.asarray(vocab.t2d))
