"""eagle3kit's own draft format: what `train` writes to OUT/final, `eval` and `convert` read.

A directory with

    draft_config.json   {"format": "eagle3kit-draft", "version": 1, "draft": DraftConfig,
                         "target": {"name", "config": the target's HF config},
                         "fingerprints": {"tokenizer", "data", "vocab"}, "training": {...}}
    draft.safetensors   the trainable weights in eagle3kit's layout (linear weights (in, out)),
                        float32 master copies
    vocab.safetensors   d2t (int64 offsets [Vd]) and t2d (bool [V])

It is written atomically (a temporary directory renamed into place).
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any

import numpy as np

from eagle3kit.core import arches
from eagle3kit.core import draft as draft_module
from eagle3kit.core.config import DraftConfig
from eagle3kit.core.draft import DraftWeights
from eagle3kit.core.sharding import to_host
from eagle3kit.core.vocab import VocabMap
from eagle3kit.errors import InputError
from eagle3kit.io import safetensors as st
from eagle3kit.io.atomic import atomic_dir

FORMAT = "eagle3kit-draft"
CONFIG = "draft_config.json"
WEIGHTS = "draft.safetensors"
VOCAB = "vocab.safetensors"


@dataclasses.dataclass
class Draft:
    """A draft in memory: config, weights (numpy or jax), vocab map, and provenance."""

    config: DraftConfig
    weights: DraftWeights  # or the weights class of the config's method (core/arches.py)
    vocab: VocabMap
    target_name: str = ""
    target_config: dict[str, Any] = dataclasses.field(default_factory=dict)
    fingerprints: dict[str, Any] = dataclasses.field(default_factory=dict)
    training: dict[str, Any] = dataclasses.field(default_factory=dict)


def weights_to_numpy(w: DraftWeights) -> dict[str, np.ndarray]:
    return {name: to_host(value) for name, value in draft_module.arrays(w).items()}


def write_vocab(path: str | os.PathLike, vocab: VocabMap, metadata: dict[str, str]) -> None:
    st.save(path, {"d2t": vocab.d2t, "t2d": vocab.t2d}, metadata)


def read_vocab(path: str | os.PathLike) -> tuple[VocabMap, dict[str, str]]:
    f = st.SafetensorsFile(path)
    missing = {"d2t", "t2d"} - set(f.names)
    if missing:
        raise InputError(f"missing {', '.join(sorted(missing))} (not a vocab file?)", path=path)
    try:
        vocab = VocabMap(np.array(f.get("d2t")), np.array(f.get("t2d")))
    except InputError as e:
        raise InputError(str(e), path=path) from None
    return vocab, dict(f.metadata)


def save_draft(directory: str | os.PathLike, draft: Draft, *, force: bool = False) -> Path:
    """Writes `draft` to `directory` atomically (replacing it only with `force`)."""
    directory = Path(directory)
    with atomic_dir(directory, force=force) as tmp:
        st.save(tmp / WEIGHTS, weights_to_numpy(draft.weights), {"format": FORMAT})
        write_vocab(tmp / VOCAB, draft.vocab, {"format": FORMAT})
        meta = {
            "format": FORMAT, "version": 1, "draft": draft.config.to_dict(),
            "target": {"name": draft.target_name, "config": draft.target_config},
            "fingerprints": draft.fingerprints, "training": draft.training,
        }
        (tmp / CONFIG).write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")
    return directory


def is_draft_dir(directory: str | os.PathLike) -> bool:
    p = Path(directory) / CONFIG
    if not p.is_file():
        return False
    try:
        return json.loads(p.read_text()).get("format") == FORMAT
    except json.JSONDecodeError:
        return False


def load_draft(directory: str | os.PathLike) -> Draft:
    """Reads a draft written by `save_draft`, checking every shape against its config."""
    directory = Path(directory)
    config_path = directory / CONFIG
    try:
        meta = json.loads(config_path.read_text())
    except FileNotFoundError:
        raise InputError(f"not an eagle3kit draft (no {CONFIG}); use `eagle3kit convert` to "
                         "import SGLang or speculators drafts", path=directory) from None
    except json.JSONDecodeError as e:
        raise InputError(f"invalid JSON ({e})", path=config_path) from None
    if meta.get("format") != FORMAT:
        raise InputError(f"unknown format {meta.get('format')!r}", path=config_path)
    cfg = DraftConfig.from_dict(meta["draft"])
    f = st.SafetensorsFile(directory / WEIGHTS)
    values = {}
    weights_class = arches.method_module(cfg.method).Weights
    for name, info in draft_module.arrays(weights_class.abstract(cfg)).items():
        if name not in f.names:
            raise InputError(f"missing tensor {name!r}", path=directory / WEIGHTS)
        value = np.array(f.get(name))
        if value.shape != info.shape:
            raise InputError(f"tensor {name!r} has shape {value.shape}, the config says "
                             f"{info.shape}", path=directory / WEIGHTS)
        values[name] = value
    vocab, _ = read_vocab(directory / VOCAB)
    if (vocab.draft_size, vocab.target_size) != (cfg.draft_vocab_size, cfg.vocab_size):
        raise InputError(f"vocab map is {vocab.draft_size}/{vocab.target_size} but the config "
                         f"says {cfg.draft_vocab_size}/{cfg.vocab_size}", path=directory)
    target = meta.get("target", {})
    return Draft(cfg, weights_class(**values), vocab, target.get("name", ""),
                 target.get("config", {}), meta.get("fingerprints", {}),
                 meta.get("training", {}))
