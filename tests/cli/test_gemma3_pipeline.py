"""The whole pipeline through the CLI on a real base model, Gemma-3-270M from its Q4_K_M
GGUF, on CPU with a small slice: mix | tokenize (with --chat-template gemma: the base
model's tokenizer has no template) | vocab-select, train a few steps, eval teacher-forced and
by speculative decoding, convert to both engine formats, the model card, and regenerate.

In one process (typer's CliRunner), as the commands would run in a shell one after another;
the GGUF header is parsed once per process (io.gguf.open_reader), so each command here pays
only its weights and compilation.
"""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from eagle3kit.cli.app import app
from tests import assets

pytestmark = pytest.mark.slow
runner = CliRunner()
F32 = ("--dtype", "float32", "--target-dtype", "float32")


def run(*args, code: int = 0):
    r = runner.invoke(app, [str(a) for a in args], env={"COLUMNS": "250"})
    if r.exception and not isinstance(r.exception, SystemExit):
        raise r.exception
    assert r.exit_code == code, r.output
    return r


def test_base_model_pipeline(sharegpt_path, tmp_path):
    gguf = assets.gemma3_gguf()
    with open(sharegpt_path, "rb") as f:  # the first records of the real file, as a file
        head = f.read(2_000_000).rsplit(b",\n  {", 1)[0] + b"]"
    (tmp_path / "slice.json").write_text(json.dumps(json.loads(head)[:60]))
    chats, data, vocab = tmp_path / "chats.jsonl", tmp_path / "tokens.jsonl", tmp_path / "v.st"
    run("mix", tmp_path / "slice.json", "-n", "16", "--seed", "0", "-o", chats)
    # generation on short first turns, a one-turn conversation first (its only turn is what
    # eval answers): long prompts past the 512-token window are test_gemma3_real's, and each
    # turn or prompt piece here costs a CPU a Gemma program or a pass over 262,144 logits
    short = [line for line in chats.read_text().splitlines(keepends=True)
             if (m := json.loads(line)["messages"])[0]["role"] == "user"
             and len(m[0]["content"]) < 200]
    prompts = tmp_path / "short.jsonl"
    prompts.write_text("".join(sorted(short, key=lambda x: len(json.loads(x)["messages"]))))

    # a base model: no template of its own, and the error says which option gives one
    r = run("tokenize", "-t", gguf, "-i", chats, "-o", data, code=2)
    assert "no chat template" in r.output and "--chat-template" in r.output
    assert "gemma" in r.output and len(r.output.strip().splitlines()) == 1
    assert not data.exists()
    run("tokenize", "-t", gguf, "--chat-template", "gemma", "-i", chats, "-o", data,
        "--max-length", "256", "-j", "1")
    first = json.loads(data.read_text().splitlines()[0])
    assert first["input_ids"][:2] == [2, 105]  # <bos><start_of_turn>
    assert first["tokenizer"].startswith("262144:")
    run("vocab-select", "-i", data, "-o", vocab, "--size", "1024", "--tokenizer", gguf)

    out = tmp_path / "run"
    run("train", "--target", gguf, "--data", data, "--vocab", vocab, "--out", out,
        "--seq-len", "256", "--batch-size", "1", "--ttt-length", "2", "--max-steps", "1",
        "--mesh", "data=1,tensor=1", *F32)
    metrics = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert metrics and all(m.get("loss", 1.0) == m.get("loss", 1.0) for m in metrics)

    few = tmp_path / "few.jsonl"  # two rows of 262,144-way logits are what a CPU spares
    few.write_text("".join(data.read_text().splitlines(keepends=True)[:2]))
    r = run("eval", "--target", gguf, "--draft", out / "final", "--data", few,
            "--seq-len", "256", "--batch-size", "1", "--mesh", "data=1,tensor=1", *F32,
            "--json")
    tf = json.loads(r.stdout)
    assert tf["mode"] == "teacher-forced" and all(0 <= a <= 1 for a in tf["acc"])

    r = run("eval", "--target", gguf, "--draft", out / "final", "--prompts", prompts,
            "--limit", "1", "--max-new-tokens", "8", "--chat-template", "gemma", *F32,
            "--json", "--samples", tmp_path / "samples.jsonl")
    gen = json.loads(r.stdout)
    assert gen["mode"] == "generate" and gen["identical_to_baseline"] == gen["prompts"] == 1
    sample = json.loads((tmp_path / "samples.jsonl").read_text().splitlines()[0])
    assert sample["prompt_ids"][-3:] == [105, 4368, 107]  # <start_of_turn>model\n

    run("convert", out / "final", "--to", "sglang", "-o", tmp_path / "sg",
        "--target-name", "google/gemma-3-270m")
    run("convert", out / "final", "--to", "speculators", "-o", tmp_path / "spec",
        "--target-name", "google/gemma-3-270m")
    spec = json.loads((tmp_path / "spec" / "config.json").read_text())
    assert spec["speculators_config"]["verifier"]["architectures"] == ["Gemma3ForCausalLM"]
    evals = tmp_path / "evals.jsonl"
    evals.write_text(json.dumps(tf) + "\n" + json.dumps(gen) + "\n")
    run("push", tmp_path / "sg", "--repo-id", "local/gemma-3-270m-eagle3", "--dry-run",
        "--eval", evals)
    assert "gemma-3-270m" in (tmp_path / "sg" / "README.md").read_text()

    # one slot of 256 positions on one device, greedy: the shape of eval's baseline engine
    # above (one row, the smallest cache), whose compiled Gemma programs this run reuses
    regen = tmp_path / "regen.jsonl"
    run("regenerate", "--target", gguf, "--chat-template", "gemma", "-i", prompts, "-o", regen,
        "--limit", "2", "--turns", "first", "--max-new-tokens", "8", "--slots", "1",
        "--max-context", "256", "--mesh", "data=1,tensor=1", "--target-dtype", "float32")
    records = [json.loads(x) for x in regen.read_text().splitlines()]
    assert len(records) == 2 and all(r["messages"][-1]["role"] == "assistant" for r in records)
