"""What every engine format (SGLang's, speculators') shares: a config.json and weights in, the
target from the most explicit source available, and an atomic export with a sidecar out.

A format module calls `load` and `export` with its own `read` and `write`.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from eagle3kit.errors import InputError, MismatchError
from eagle3kit.formats import common, torch_bin
from eagle3kit.formats.registry import ExportOptions
from eagle3kit.io import safetensors as st
from eagle3kit.io.atomic import atomic_dir
from eagle3kit.io.draft_io import Draft
from eagle3kit.io.hf import target_hf_config
from eagle3kit.io.hub import is_hub_id


def read_json(path: Path) -> dict:
    try:
        d = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise InputError(f"invalid JSON ({e})", path=path) from None
    if not isinstance(d, dict):
        raise InputError("expected a JSON object", path=path)
    return d


def read_tensors(directory: Path) -> dict:
    """Every tensor of a checkpoint directory (safetensors, sharded or not, or a .bin)."""
    files = st.checkpoint_files(directory)
    if files:
        tensors: dict = {}
        for f in files:
            part, _ = st.load(f)
            tensors.update(part)
        return tensors
    bins = sorted(directory.glob("pytorch_model*.bin"))
    if bins:
        tensors = {}
        for f in bins:
            tensors.update(torch_bin.load(f))
        return tensors
    raise InputError("no weights (*.safetensors or pytorch_model.bin)", path=directory)


def tensor_names(directory: Path) -> list[str]:
    names: list[str] = []
    for f in st.checkpoint_files(directory):
        names += st.SafetensorsFile(f).names
    return names


def _target(kind: str, config: dict, sidecar: dict | None, target: str | None,
            directory: Path, verifier: str) -> tuple[str, dict]:
    """(name, HF config) of the draft's target, from the most explicit source available."""
    recorded = (sidecar or {}).get("target") or {}
    if target:
        name, hf = target_hf_config(target)
    elif recorded.get("config"):
        name, hf = recorded.get("name", ""), recorded["config"]
    elif verifier:
        name, hf = target_hf_config(verifier)
    else:
        raise MismatchError(f"cannot determine the draft's target: {kind} checkpoints do not "
                            "record it; pass --target MODEL (a directory, .gguf file or Hub "
                            "id)", path=directory)
    return recorded.get("name") or verifier or name, hf


Read = Callable[[Path, dict, dict, dict], tuple[Any, Any, Any]]


def load(directory: Path, target: str | None, kind: str, read: Read,
         verifier: Callable[[dict], str] | None = None) -> Draft:
    """The draft of an engine export: `read(directory, config, tensors, target_hf_config)`
    gives (DraftConfig, DraftWeights, VocabMap); the target is `target` (directory, .gguf or
    Hub id), else the export's sidecar, else the verifier the config names."""
    config = read_json(directory / "config.json")
    sidecar = common.read_sidecar(directory)
    name, hf = _target(kind, config, sidecar, target, directory,
                       verifier(config) if verifier else "")
    cfg, weights, vocab = read(directory, config, read_tensors(directory), hf)
    return Draft(cfg, weights, vocab, name, hf, (sidecar or {}).get("fingerprints", {}),
                 (sidecar or {}).get("training", {}))


def export(draft: Draft, out: Path, options: ExportOptions, kind: str,
           write: Callable[[Path, Draft], object]) -> Path:
    """Writes `out` atomically: what `write(directory, draft)` writes (the draft's layers in
    order) and the `eagle3kit.json` sidecar (provenance for `push`; engines ignore it)."""
    if draft.target_name and not is_hub_id(draft.target_name):
        common.log.warning(
            "the target is recorded as %r, not a Hub id: the model card gets no base_model "
            "and `vllm serve DIR` looks for the verifier there; pass --target-name ORG/MODEL",
            draft.target_name)
    draft = common.in_layer_order(draft)
    with atomic_dir(out, force=options.force) as tmp:
        write(tmp, draft)
        common.write_sidecar(tmp, draft, kind, options.dtype, {
            "speculative_tokens": options.speculative_tokens, "source": options.source,
            # what `eval --json` of the source and of this export record (push checks)
            "draft_digest": common.draft_digest(draft),
            "export_digest": common.draft_digest(draft, via=options.dtype)})
    return out
