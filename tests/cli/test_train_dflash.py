"""`train --arch dflash` and `eval --data` of the draft it writes: the same data and trainer as
EAGLE-3, the target's head kept frozen, acceptance per block slot, and bad options."""

from __future__ import annotations

import json

import numpy as np
import pytest

from eagle3kit.io.draft_io import load_draft
from eagle3kit.io.hf import resolve_target
from tests import assets
from tests.cli.test_train import invoke

ONE = ["--mesh", "data=1,tensor=1", "--dtype", "float32", "--target-dtype", "float32"]


@pytest.fixture(scope="module")
def a():
    return assets.train_assets()


def args(a, out, *extra):
    return ["train", "--target", str(a / "target"), "--data", str(a / "train.jsonl"),
            "--vocab", str(a / "vocab.safetensors"), "--out", str(out), "--seq-len", "128",
            "--batch-size", "2", "--epochs", "1", "--lr", "1e-3", "--arch", "dflash",
            "--block-size", "4", "--draft-layers", "2", *ONE, *extra]


def target_head(a) -> np.ndarray:
    from safetensors.numpy import load_file
    ckpt = resolve_target(a / "target")
    tensors = {}
    for f in (a / "target").glob("*.safetensors"):
        tensors.update(load_file(f))
    head = tensors.get("lm_head.weight", tensors["model.embed_tokens.weight"])
    assert head.shape[0] == ckpt.config.vocab_size
    return head


def test_dflash_trains_and_eval_data_reads_its_slots(a, tmp_path):
    out = tmp_path / "run"
    r = invoke(args(a, out, "--max-steps", "2", "--eval-data", str(a / "heldout.jsonl"),
                    "--eval-every", "2"))
    assert r.exit_code == 0, r.output
    final = load_draft(out / "final")
    cfg = final.config
    assert (cfg.arch, cfg.num_layers, cfg.block_size) == ("dflash", 2, 4)
    assert cfg.mask_token_id == cfg.vocab_size - 1
    # the head is the target's over the draft vocab, and training left it there
    np.testing.assert_array_equal(final.weights.lm_head,
                                  target_head(a)[final.vocab.used_ids].T)
    assert final.weights.q.shape[0] == 2
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    evals = [x for x in rows if x.get("eval")]
    assert [len(e["acc"]) for e in evals] == [3, 3] and evals[-1]["masked_tokens"] > 50
    assert all(np.isfinite(x["loss"]) for x in rows if not x.get("eval"))
    # eval --data: the trainer's own counts on the same anchors, so the run's last evaluation
    r = invoke(["eval", "--target", str(a / "target"), "--draft", str(out / "final"),
                "--data", str(a / "heldout.jsonl"), "--seq-len", "128", "--json", *ONE])
    assert r.exit_code == 0, r.output
    report = json.loads(r.output.strip().splitlines()[-1])
    assert report["steps"] == 3 and report["acc"] == evals[-1]["acc"]
    assert report["tau"] == evals[-1]["tau"]
    # eval --prompts decodes with it through the engine: tests/cli/test_eval_parallel.py


@pytest.mark.parametrize("option,value,message", [
    ("--block-size", "1", "--block-size 1: must be at least 2"),
    ("--block-size", "128", "--block-size 128: must be less than --seq-len 128"),
    ("--anchors", "-1", "--anchors -1: must not be negative"),
    ("--draft-layers", "0", "--draft-layers 0: must be at least 1"),
    ("--mask-token-id", "999999", "--mask-token-id 999999 is outside the target's vocabulary"),
])
def test_bad_dflash_options_are_one_line(a, tmp_path, option, value, message):
    out = tmp_path / "run"
    r = invoke(args(a, out, option, value))
    assert r.exit_code == 2 and message in r.output, r.output
    assert len(r.output.strip().splitlines()) == 1 and not out.exists()
