"""The whole pipeline through the CLI for a tiny random model of each new family:
tokenize -> vocab-select -> train -> eval -> convert (both engine formats).

Each target is a tiny random Qwen3-MoE, gpt-oss or Gemma-3 saved as a Hugging Face directory
with a tokenizer and its family's chat template (tests/data/chat_tokenizers.py), trained on
real ShareGPT conversations on a mesh that splits heads and experts (data=4, tensor=2).
"""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from eagle3kit.cli.app import app
from eagle3kit.data.records import encode
from tests import assets
from tests.data import chat_tokenizers

pytestmark = pytest.mark.slow
runner = CliRunner()
# family -> the chat tokenizer whose template its instruct models ship
TOKENIZERS = {"qwen3_moe": "qwen3", "gpt_oss": "gpt_oss", "gemma3": "gemma3"}
ARCHITECTURES = {"qwen3_moe": "Qwen3MoeForCausalLM", "gpt_oss": "GptOssForCausalLM",
                 "gemma3": "Gemma3ForCausalLM"}


def run(*args):
    r = runner.invoke(app, [str(a) for a in args], env={"COLUMNS": "250"})
    if r.exception and not isinstance(r.exception, SystemExit):
        raise r.exception
    assert r.exit_code == 0, r.output
    return r


@pytest.fixture(scope="module")
def chats(tmp_path_factory):
    path = tmp_path_factory.mktemp("chats") / "chats.jsonl"
    path.write_bytes(b"".join(encode(c) for c in assets.sharegpt_chats(24)))
    return path


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss", "gemma3"])
def test_pipeline(family, chats, tmp_path):
    tok = getattr(chat_tokenizers, TOKENIZERS[family])()
    target = tmp_path / "target"
    assets.tiny_hf_model(family, target, vocab_size=len(tok), num_hidden_layers=4)
    tok.save_pretrained(target)
    data, vocab, out = tmp_path / "train.jsonl", tmp_path / "vocab.safetensors", tmp_path / "run"
    r = run("tokenize", "-t", target, "-i", chats, "-o", data, "--max-length", "256", "-j", "1")
    assert "conversations written" in r.output
    run("vocab-select", "-i", data, "-o", vocab, "--size", "512", "--tokenizer", target)
    run("train", "--target", target, "--data", data, "--vocab", vocab, "--out", out,
        "--seq-len", "128", "--batch-size", "4", "--ttt-length", "1", "--epochs", "1",
        "--max-steps", "2", "--mesh", "data=4,tensor=2", "--dtype", "float32",
        "--target-dtype", "float32", "--aux-layers", "1,2,3")
    r = run("eval", "--target", target, "--draft", out / "final", "--data", data,
            "--seq-len", "128", "--batch-size", "4", "--steps", "1", "--mesh", "data=4,tensor=2",
            "--dtype", "float32", "--target-dtype", "float32", "--json")
    report = json.loads(r.stdout)
    assert report["mode"] == "teacher-forced" and all(0 <= a <= 1 for a in report["acc"])
    run("convert", out / "final", "--to", "sglang", "-o", tmp_path / "sg",
        "--target-name", f"org/tiny-{family}")
    run("convert", out / "final", "--to", "speculators", "-o", tmp_path / "spec",
        "--target-name", f"org/tiny-{family}")
    sg = json.loads((tmp_path / "sg" / "config.json").read_text())
    spec = json.loads((tmp_path / "spec" / "config.json").read_text())
    assert sg["architectures"] == ["LlamaForCausalLMEagle3"] and sg["draft_vocab_size"] == 512
    verifier = spec["speculators_config"]["verifier"]
    assert verifier["architectures"] == [ARCHITECTURES[family]]
    layer = spec["transformer_layer_config"]
    if family == "gpt_oss":  # the draft's rope is plain (no YaRN mscale in the draft head)
        assert layer["rope_scaling"] is None and layer["rope_theta"] == 150000.0
