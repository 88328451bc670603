"""Training checkpoints: written atomically, verified on resume.

    RUN/checkpoints/step_00000120/
        state.safetensors   every leaf of the train state (draft weights, AdamW moments, step),
                            named by its pytree path
        meta.json           step, epoch, position in the epoch, seed, sha256 of state.safetensors

A checkpoint directory appears only after both files are complete (temporary directory, then
rename), so a kill at any moment leaves the previous checkpoints intact; the checksum catches
a file damaged later. Only the newest `keep` checkpoints are kept.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

import jax
import numpy as np

from eagle3kit.core.sharding import to_host
from eagle3kit.errors import InputError
from eagle3kit.io import safetensors as st
from eagle3kit.io.atomic import atomic_dir

STATE = "state.safetensors"
META = "meta.json"
_NAME = re.compile(r"^step_(\d{8})$")


def file_sha256(path: str | os.PathLike) -> str:
    """sha256 of a file's bytes, read in 4 MiB chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def flatten(tree: Any) -> dict[str, np.ndarray]:
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    return {jax.tree_util.keystr(path): to_host(leaf) for path, leaf in leaves}


def checkpoint_dir(run_dir: Path) -> Path:
    return Path(run_dir) / "checkpoints"


def save(run_dir: Path, state: Any, meta: dict[str, Any], keep: int = 2) -> Path:
    """Writes the checkpoint of `meta["step"]` and prunes older ones beyond `keep`."""
    root = checkpoint_dir(run_dir)
    path = root / f"step_{int(meta['step']):08d}"
    tensors = flatten(state)
    with atomic_dir(path, force=True) as tmp:
        st.save(tmp / STATE, tensors)
        meta = {**meta, "sha256": file_sha256(tmp / STATE)}
        (tmp / META).write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")
    for old in list_checkpoints(run_dir)[:-keep] if keep > 0 else []:
        shutil.rmtree(old, ignore_errors=True)
    return path


def list_checkpoints(run_dir: Path) -> list[Path]:
    root = checkpoint_dir(run_dir)
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if p.is_dir() and _NAME.match(p.name))


def load(path: Path, abstract_state: Any) -> tuple[Any, dict[str, Any]]:
    """Reads a checkpoint into numpy leaves shaped like `abstract_state`; verifies it first."""
    meta_path, state_path = path / META, path / STATE
    try:
        meta = json.loads(meta_path.read_text())
    except FileNotFoundError:
        raise InputError("checkpoint is incomplete (no meta.json)", path=path) from None
    except json.JSONDecodeError as e:
        raise InputError(f"corrupted checkpoint metadata ({e})", path=meta_path) from None
    if not state_path.is_file():
        raise InputError("checkpoint is incomplete (no state.safetensors)", path=path)
    if file_sha256(state_path) != meta.get("sha256"):
        raise InputError("corrupted checkpoint: checksum mismatch (the file changed after it "
                         "was written); remove this directory to resume from an older one",
                         path=state_path)
    f = st.SafetensorsFile(state_path)
    leaves, treedef = jax.tree_util.tree_flatten_with_path(abstract_state)
    out = []
    for p, leaf in leaves:
        name = jax.tree_util.keystr(p)
        if name not in f.names:
            raise InputError(f"checkpoint has no {name} (written by another configuration?)",
                             path=state_path)
        value = np.array(f.get(name))
        if value.shape != tuple(leaf.shape):
            raise InputError(f"checkpoint {name} has shape {value.shape}, this run needs "
                             f"{tuple(leaf.shape)} (different --ttt-length, vocab or target?)",
                             path=state_path)
        out.append(value.astype(leaf.dtype))
    return jax.tree_util.tree_unflatten(treedef, out), meta
