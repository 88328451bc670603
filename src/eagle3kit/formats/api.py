"""The public API of `eagle3kit.formats` (see its docstring), over the registered formats."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

from eagle3kit.errors import InputError
from eagle3kit.formats import common, registry
from eagle3kit.formats.engine import read_json
from eagle3kit.formats.registry import DraftFormat, ExportOptions
from eagle3kit.io.draft_io import Draft, is_draft_dir
from eagle3kit.io.hub import is_hub_id, snapshot

# what an export holds: the files `export_draft` writes in either layout, and push's card
_EXPORT_FILES = {common.SIDECAR, common.WEIGHTS, "config.json", "README.md",
                 "draft_config.json", "draft.safetensors", "vocab.safetensors"}


def _readable() -> tuple[DraftFormat, ...]:
    """The formats in the order detection asks them: the latest registered first, so that a
    format added later is named first when a directory looks like two."""
    return registry.formats()[::-1]


def _known(fmt: str) -> DraftFormat:
    found = registry.get(fmt)
    if found is None:
        raise InputError(f"unknown format {fmt!r}; choose one of "
                         f"{', '.join(registry.names())}")
    return found


def detect_format(directory: str | os.PathLike) -> str:
    """Which draft format a directory holds; unknown or ambiguous is an `InputError`."""
    directory = Path(directory)
    config_path = directory / "config.json"
    config = read_json(config_path) if config_path.is_file() else None
    found = [f.name for f in _readable() if f.detect(directory, config)]
    if not found:  # weaker signs (e.g. midlayer tensors under a generic Llama architecture)
        found = [f.name for f in _readable() if f.guess(directory, config)]
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
        expected = registry.spoken([f.expects for f in _readable()])
        raise InputError(f"unknown draft format{arch}: expected {expected}; found {seen}",
                         path=directory)
    raise InputError(f"ambiguous draft format: it looks like {' and '.join(found)}; pass "
                     "--from FORMAT", path=directory)


def _resolve_source(source: str) -> Path:
    path = Path(source).expanduser()
    if path.is_dir():
        return path
    if path.exists():
        kinds = registry.spoken([f.display for f in _readable()])
        raise InputError(f"a draft is a directory ({kinds} format), not a file", path=path)
    if is_hub_id(source):
        return snapshot(source, ["*.json", "*.safetensors", "pytorch_model*.bin"], "the draft")
    raise InputError("no such draft: not a directory or Hub id", path=source)


def load_any_draft(source: str | os.PathLike, *, target: str | None = None,
                   target_name: str | None = None, fmt: str = "auto") -> Draft:
    """A draft in memory (fp32 weights) from a directory or Hub id in any registered format."""
    directory = _resolve_source(str(source))
    draft = _known(detect_format(directory) if fmt == "auto" else fmt).load(directory, target)
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
    found = _known(fmt)
    if out.exists() and not force:
        raise FileExistsError(str(out))
    dtype = common.dtype_name(dtype)
    if target_name:
        draft = dataclasses.replace(draft, target_name=target_name)
    return found.export(draft, out, ExportOptions(dtype, force, speculative_tokens,
                                                  source or ""))
