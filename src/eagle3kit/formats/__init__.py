"""Draft formats: eagle3kit's own, SGLang's midlayer format, and speculators (vLLM).

The public API other modules call:

    load_any_draft(source, target=None, target_name=None, fmt="auto") -> Draft
        `source` is a local directory or a Hub id of a draft in any of the three formats
        (auto-detected). Engine formats do not always record their target; it comes from
        `target` (directory, .gguf or Hub id), the export's sidecar, or the speculators
        verifier name, in that order.
    export_draft(draft, fmt, out_dir, dtype="bfloat16", force=False, ...) -> Path
        Validates, then writes atomically: nothing appears at `out_dir` unless all of it does.
    detect_format(directory) -> "eagle3kit" | "sglang" | "speculators"
    check_replaceable(out_dir, source)
        Refuses an output that is, holds or lies inside the source, and an existing output
        that is not recognisably an earlier export (what `--force` may replace).
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

from eagle3kit.errors import InputError, MismatchError
from eagle3kit.formats import common, sglang, speculators, torch_bin
from eagle3kit.io import safetensors as st
from eagle3kit.io.atomic import atomic_dir
from eagle3kit.io.draft_io import Draft, is_draft_dir, load_draft, save_draft
from eagle3kit.io.hf import target_hf_config
from eagle3kit.io.hub import is_hub_id, snapshot

FORMATS = ("eagle3kit", "sglang", "speculators")
_ENGINES = {"sglang": sglang, "speculators": speculators}

__all__ = ["FORMATS", "check_replaceable", "detect_format", "export_draft", "load_any_draft",
           "read_tensors"]

# what an export holds: the files `export_draft` writes in either layout, and push's card
_EXPORT_FILES = {common.SIDECAR, common.WEIGHTS, "config.json", "README.md",
                 "draft_config.json", "draft.safetensors", "vocab.safetensors"}


def _read_json(path: Path) -> dict:
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


def detect_format(directory: str | os.PathLike) -> str:
    """Which draft format a directory holds; unknown or ambiguous is an `InputError`."""
    directory = Path(directory)
    found = []
    if is_draft_dir(directory):
        found.append("eagle3kit")
    config_path = directory / "config.json"
    config = _read_json(config_path) if config_path.is_file() else None
    if config is not None:
        if speculators.is_speculators(config):
            found.append("speculators")
        if sglang.is_sglang(config):
            found.append("sglang")
        if not found and any(n.startswith(sglang.LAYER) for n in _tensor_names(directory)):
            found.append("sglang")  # midlayer tensors under a generic Llama architecture
    if len(found) == 1:
        return found[0]
    final = directory / "final"
    if not found and ((directory / "checkpoints").is_dir() or is_draft_dir(final)):
        raise InputError(f"is a training run, not a draft; its draft is {final}" if
                         is_draft_dir(final) else "is a training run with no final draft yet "
                         "(it stopped at a checkpoint: finish it with train --resume)",
                         path=directory)
    if not found:
        seen = ", ".join(sorted(p.name for p in directory.iterdir())[:8]) or "nothing"
        arch = f" (architectures {config.get('architectures')})" if config else ""
        raise InputError(f"unknown draft format{arch}: expected draft_config.json (eagle3kit), "
                         "config.json with LlamaForCausalLMEagle3 (SGLang) or "
                         f"speculators_model_type (speculators); found {seen}", path=directory)
    raise InputError(f"ambiguous draft format: it looks like {' and '.join(found)}; pass "
                     "--from FORMAT", path=directory)


def _tensor_names(directory: Path) -> list[str]:
    names: list[str] = []
    for f in st.checkpoint_files(directory):
        names += st.SafetensorsFile(f).names
    return names


def _resolve_source(source: str) -> Path:
    path = Path(source).expanduser()
    if path.is_dir():
        return path
    if path.exists():
        raise InputError("a draft is a directory (eagle3kit, SGLang or speculators format), "
                         "not a file", path=path)
    if is_hub_id(source):
        return snapshot(source, ["*.json", "*.safetensors", "pytorch_model*.bin"], "the draft")
    raise InputError("no such draft: not a directory or Hub id", path=source)


def _target(kind: str, config: dict, sidecar: dict | None, target: str | None,
            directory: Path) -> tuple[str, dict]:
    """(name, HF config) of the draft's target, from the most explicit source available."""
    recorded = (sidecar or {}).get("target") or {}
    verifier = speculators.verifier_name(config) if kind == "speculators" else ""
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


def load_any_draft(source: str | os.PathLike, *, target: str | None = None,
                   target_name: str | None = None, fmt: str = "auto") -> Draft:
    """A draft in memory (fp32 weights) from a directory or Hub id in any supported format."""
    directory = _resolve_source(str(source))
    kind = detect_format(directory) if fmt == "auto" else fmt
    if kind not in FORMATS:
        raise InputError(f"unknown format {kind!r}; choose one of {', '.join(FORMATS)}")
    if kind == "eagle3kit":
        draft = load_draft(directory)
        if target:
            name, hf = target_hf_config(target)
            draft = dataclasses.replace(draft, target_config=hf,
                                        target_name=draft.target_name or name)
    else:
        config = _read_json(directory / "config.json")
        sidecar = common.read_sidecar(directory)
        name, hf = _target(kind, config, sidecar, target, directory)
        cfg, weights, vocab = _ENGINES[kind].read(directory, config, read_tensors(directory), hf)
        draft = Draft(cfg, weights, vocab, name, hf, (sidecar or {}).get("fingerprints", {}),
                      (sidecar or {}).get("training", {}))
    if target_name:
        draft = dataclasses.replace(draft, target_name=target_name)
    if draft.target_config:  # the same checks an export makes: fail here, not in the engine
        common.check_exportable(draft, min_layer_id=0)
    return draft


def check_replaceable(out_dir: str | os.PathLike, source: str | os.PathLike) -> None:
    """Before any work: `out_dir` must not be, hold or lie inside a local `source`; an existing
    `out_dir` (which `--force` replaces whole) must be an export written by eagle3kit and
    hold nothing else, so no training run and no file of the user's is ever deleted."""
    out = Path(out_dir).resolve()
    src = Path(source).resolve() if Path(source).exists() else None
    if src is not None and (out == src or src in out.parents or out in src.parents):
        where = ("is the source draft" if out == src else
                 "lies inside the source draft" if src in out.parents else
                 "holds the source draft")
        raise InputError(f"{where} {source}; write the export to another directory",
                         path=out_dir)
    if not Path(out_dir).exists():
        return
    if not out.is_dir():
        raise InputError("is a file, not an export directory; remove it yourself or choose "
                         "another -o", path=out_dir)
    readme = out / "README.md"  # push's card carries its marker (hub.card.MARKER)
    ours = _EXPORT_FILES - ({"README.md"} if readme.is_file() and "generated by eagle3kit"
                            not in readme.read_text(errors="replace") else set())
    foreign = sorted(p.name for p in out.iterdir() if p.name not in ours or not p.is_file())
    if not (is_draft_dir(out) or (out / common.SIDECAR).is_file()) or foreign:
        why = (f"it holds files eagle3kit did not write ({', '.join(foreign[:4])})" if foreign
               else "it is not an export written by eagle3kit")
        raise InputError(f"--force replaces only an earlier export, and {why}; remove it "
                         "yourself or choose another -o", path=out_dir)
    if (out.parent / "config.json").is_file() and (out.parent / "checkpoints").is_dir():
        raise InputError(f"is the draft of the training run {out.parent}; --force does not "
                         "replace it: choose another -o", path=out_dir)


def export_draft(draft: Draft, fmt: str, out_dir: str | os.PathLike, dtype: str = "bfloat16",
                 force: bool = False, *, target_name: str | None = None,
                 speculative_tokens: int = 3, source: str | None = None) -> Path:
    """Writes `draft` to `out_dir` in `fmt`; an existing `out_dir` is replaced only with `force`.

    Engine formats get `dtype` weights (d2t int64, t2d bool) and an `eagle3kit.json` sidecar
    (provenance for `push`; engines ignore it). The eagle3kit format keeps fp32 weights.
    """
    out = Path(out_dir)
    if fmt not in FORMATS:
        raise InputError(f"unknown format {fmt!r}; choose one of {', '.join(FORMATS)}")
    if out.exists() and not force:
        raise FileExistsError(str(out))
    dtype = common.dtype_name(dtype)
    if target_name:
        draft = dataclasses.replace(draft, target_name=target_name)
    if fmt == "eagle3kit":
        return save_draft(out, draft, force=force)
    if draft.target_name and not is_hub_id(draft.target_name):
        common.log.warning(
            "the target is recorded as %r, not a Hub id: the model card gets no base_model "
            "and `vllm serve DIR` looks for the verifier there; pass --target-name ORG/MODEL",
            draft.target_name)
    draft = common.in_layer_order(draft)
    with atomic_dir(out, force=force) as tmp:
        if fmt == "sglang":
            sglang.write(tmp, draft, dtype)
        else:
            speculators.write(tmp, draft, dtype, speculative_tokens)
        common.write_sidecar(tmp, draft, fmt, dtype, {
            "speculative_tokens": speculative_tokens, "source": source or "",
            # what `eval --json` of the source and of this export record (push checks)
            "draft_digest": common.draft_digest(draft),
            "export_digest": common.draft_digest(draft, via=dtype)})
    return out
