"""`train --arch peagle` on the data and trainer EAGLE-3 uses, `eval --data` reading its
acceptance per block position (`eval --prompts` decodes with it: tests/cli/test_eval_parallel.py)."""

from __future__ import annotations

import json

import numpy as np
from typer.testing import CliRunner

from eagle3kit.cli.app import app
from eagle3kit.io.draft_io import load_draft
from tests import assets


def invoke(*args):
    return CliRunner().invoke(app, list(map(str, args)), env={"COLUMNS": "250"})


def test_peagle_trains_and_eval_data_reads_its_block_positions(tmp_path):
    a = assets.train_assets()
    out = tmp_path / "run"
    r = invoke("train", "--target", a / "target", "--data", a / "train.jsonl", "--vocab",
               a / "vocab.safetensors", "--out", out, "--seq-len", "128", "--batch-size", "2",
               "--ttt-length", "3", "--max-steps", "2", "--mesh", "data=1,tensor=1",
               "--dtype", "float32", "--target-dtype", "float32", "--arch", "peagle")
    assert r.exit_code == 0, r.output
    final = load_draft(out / "final")
    target_hf = json.loads((a / "target" / "config.json").read_text())
    assert final.config.arch == "peagle" and final.config.block_size == 3
    assert final.config.mask_token_id == (target_hf.get("pad_token_id")
                                          if target_hf.get("pad_token_id") is not None
                                          else final.config.vocab_size - 1)
    losses = [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().split()
              if "loss" in line]
    assert len(losses) == 2 and np.isfinite(losses).all()
    r = invoke("eval", "--target", a / "target", "--draft", out / "final", "--data",
               a / "heldout.jsonl", "--seq-len", "128", "--batch-size", "2", "--mesh",
               "data=1,tensor=1", "--json")
    assert r.exit_code == 0, r.output
    result = json.loads(next(line for line in r.stdout.splitlines() if line.startswith("{")))
    assert len(result["acc"]) == 3, result  # one per block position
