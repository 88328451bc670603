"""eagle3kit's own draft format (`io/draft_io.py`: draft_config.json, draft.safetensors,
vocab.safetensors, fp32), what `train` writes, as a registered format."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from eagle3kit.formats.registry import ExportOptions
from eagle3kit.io.draft_io import Draft, is_draft_dir, load_draft, save_draft
from eagle3kit.io.hf import target_hf_config

EXPECTS = "draft_config.json (eagle3kit)"
DTYPE = "float32"  # training's master weights: a round trip through this format is exact


def detect(directory: Path, config: dict | None) -> bool:
    return is_draft_dir(directory)


def load(directory: Path, target: str | None) -> Draft:
    draft = load_draft(directory)
    if target:  # a newer or local copy of the target's config
        name, hf = target_hf_config(target)
        draft = dataclasses.replace(draft, target_config=hf,
                                    target_name=draft.target_name or name)
    return draft


def export(draft: Draft, out: Path, options: ExportOptions) -> Path:
    return save_draft(out, draft, force=options.force)
