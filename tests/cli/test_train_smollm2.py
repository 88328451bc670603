"""`eagle3kit train` through the CLI on the real SmolLM2-135M-Instruct (its GGUF) and real
ShareGPT conversations, on CPU (slow)."""

from __future__ import annotations

import json

import pytest

from tests import assets
from tests.cli.test_train import invoke


@pytest.mark.slow
def test_smollm2_draft_learns_on_real_sharegpt(tmp_path):
    """The real SmolLM2-135M-Instruct and 200 real ShareGPT conversations on CPU: held-out
    acc_0 rises clearly above the untrained draft's within a short run."""
    tok = assets.smollm2_tokenizer()
    n = assets.write_token_records(tmp_path / "train.jsonl", assets.sharegpt_chats(200), tok,
                                   max_length=128)
    assets.write_token_records(tmp_path / "held.jsonl", assets.sharegpt_chats(20, skip=200),
                               tok, max_length=128)
    assets.write_vocab_for(tmp_path / "train.jsonl", tmp_path / "vocab.safetensors", 2048, tok)
    assert n > 150
    out = tmp_path / "run"
    r = invoke(["train", "--target", str(assets.smollm2_gguf()),
                "--data", str(tmp_path / "train.jsonl"),
                "--vocab", str(tmp_path / "vocab.safetensors"), "--out", str(out),
                "--seq-len", "128", "--batch-size", "4", "--ttt-length", "2",
                "--max-steps", "12", "--mesh", "data=1,tensor=1", "--dtype", "float32",
                "--target-dtype", "float32", "--lr", "3e-3", "--warmup-ratio", "0.05",
                "--eval-data", str(tmp_path / "held.jsonl"), "--eval-every", "12"])
    assert r.exit_code == 0, r.output
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    before, after = [x["acc"][0] for x in rows if x.get("eval")]
    assert after > before + 0.05 and after > 0.08, (before, after)


