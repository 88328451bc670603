"""`eagle3kit tokenize` through the CLI, and the issue's whole pipeline through a real shell:

    eagle3kit mix sharegpt.json -n N | eagle3kit tokenize --tokenizer SmolLM2.gguf \\
      | tee train.jsonl | eagle3kit vocab-select --size Vd -o vocab.safetensors
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
from typer.testing import CliRunner

from eagle3kit.cli.app import app
from eagle3kit.data.chat import render
from eagle3kit.data.fingerprint import Fingerprint, tokenizer_fingerprint
from eagle3kit.data.records import ChatRecord, encode, read_token_records
from eagle3kit.io.draft_io import read_vocab
from tests import assets
from tests.data import chat_tokenizers, real_data

pytestmark = pytest.mark.slow
runner = CliRunner()


def tokenize(*args, input=None):
    # one job unless a test asks: in this (JAX-loaded) process workers are spawned, which
    # costs seconds; the shell pipeline below runs the default (forked) workers
    jobs = [] if "-j" in args else ["-j", "1"]
    return runner.invoke(app, ["tokenize", *map(str, args), *jobs], input=input,
                         env={"COLUMNS": "250"})


@pytest.fixture(scope="module")
def chats(tmp_path_factory):
    path = tmp_path_factory.mktemp("chats") / "chats.jsonl"
    path.write_bytes(b"".join(encode(c) for c in assets.sharegpt_chats(24)))
    return path


def test_pipeline_through_a_real_shell(tmp_path, smollm2_gguf):
    sharegpt = real_data.sharegpt_array(300)
    exe = [sys.executable, "-m", "eagle3kit"]
    cmd = (f"set -o pipefail; {' '.join(exe)} mix {sharegpt} -n 60 --seed 0 "
           f"| {' '.join(exe)} tokenize --tokenizer {smollm2_gguf} --max-length 1024 "
           f"| tee {tmp_path}/train.jsonl "
           f"| {' '.join(exe)} vocab-select --size 4000 -o {tmp_path}/vocab.safetensors")
    env = {**os.environ, "COLUMNS": "250"}
    p = subprocess.run(["bash", "-c", cmd], capture_output=True, text=True, env=env,
                       timeout=300)
    assert p.returncode == 0, p.stderr
    assert p.stdout == ""  # every human-readable line went to stderr
    records = list(read_token_records(tmp_path / "train.jsonl"))
    key = tokenizer_fingerprint(chat_tokenizers.smollm2(), "x").key
    assert 50 <= len(records) <= 60 and all(r.tokenizer == key for r in records)
    assert all(len(r.input_ids) <= 1024 and 1 in r.loss_mask for r in records)
    assert "wrote 60 conversations" in p.stderr and "conversations written" in p.stderr
    vocab, meta = read_vocab(tmp_path / "vocab.safetensors")
    used = np.arange(4000) + vocab.d2t
    assert np.all(np.diff(used) > 0) and np.array_equal(used, np.flatnonzero(vocab.t2d))
    assert Fingerprint.from_json(meta["tokenizer"]).key == key
    assert meta["draft_vocab_size"] == "4000" and meta["target_vocab_size"] == "49152"
    assert f"coverage {float(meta['coverage']):.2%}" in p.stderr


def test_file_stdin_and_jobs_give_the_same_bytes(chats, tmp_path):
    tok = chat_tokenizers.saved("smollm2")
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    r = tokenize("--tokenizer", tok, "-i", chats, "-o", a, "-j", 1)
    assert r.exit_code == 0, r.output
    assert tokenize("--tokenizer", tok, "-i", chats, "-o", b, "-j", 2).exit_code == 0
    piped = tokenize("--tokenizer", tok, input=chats.read_text())
    assert piped.exit_code == 0, piped.output
    assert a.read_bytes() == b.read_bytes() == piped.stdout.encode()
    assert "24 of 24 conversations written" in r.stderr


def test_plain_progress_lines_in_logs(chats, tmp_path, monkeypatch):
    """stderr is not a terminal: no live bar, plain lines (here one per batch of work)."""
    from eagle3kit.cli import tokenize as tokenize_cli

    monkeypatch.setattr(tokenize_cli, "PROGRESS_SECONDS", 0.0)
    r = tokenize("--tokenizer", chat_tokenizers.saved("smollm2"), "-i", chats, "-o",
                 tmp_path / "t.jsonl")
    assert r.exit_code == 0, r.output
    counts = [int(x.split()[-1].replace(",", "")) for x in r.stderr.splitlines()
              if x.startswith("tokenize: conversations ")]
    assert counts and counts[-1] == 24 and counts == sorted(counts), r.stderr
    assert "\x1b[" not in r.stderr


def test_records_follow_the_template_and_mode(chats, tmp_path):
    chat = ChatRecord(**json.loads(chats.read_text().split("\n")[0]))
    tok = chat_tokenizers.qwen3()
    outs = {}
    for flag in ("--thinking", "--no-thinking"):
        r = tokenize("--tokenizer", chat_tokenizers.saved("qwen3"), flag, input=encode(chat))
        assert r.exit_code == 0, r.output
        outs[flag] = json.loads(r.stdout)
        thinking = flag == "--thinking"
        ids, mask = render(tok, chat.messages, thinking=thinking)
        assert (outs[flag]["input_ids"], outs[flag]["loss_mask"]) == (ids, mask)
    assert sum(outs["--thinking"]["loss_mask"]) > sum(outs["--no-thinking"]["loss_mask"])


def test_custom_chat_template_file(chats, tmp_path):
    template = tmp_path / "llama.jinja"
    template.write_text(chat_tokenizers.llama3().chat_template)
    r = tokenize("--tokenizer", chat_tokenizers.saved("llama3"), "--chat-template", template,
                 "-i", chats)
    assert r.exit_code == 0, r.output
    first = json.loads(r.stdout.split("\n")[0])
    assert chat_tokenizers.llama3().decode(first["input_ids"][:5]).startswith(
        "<|begin_of_text|><|start_header_id|>system")


def test_base_model_needs_a_named_template(chats, tmp_path):
    """A tokenizer without a chat template (a base model's) is refused in one line that
    names --chat-template and the known names; `--chat-template gemma` then writes exactly
    the records Gemma-3's published template gives."""
    own = chat_tokenizers.saved("gemma3")
    base = tmp_path / "base"
    base.mkdir()
    for f in own.iterdir():
        if f.name != "chat_template.jinja":  # where transformers 5 saves the template
            (base / f.name).write_bytes(f.read_bytes())
    r = tokenize("--tokenizer", base, "-i", chats)
    assert r.exit_code == 2 and len(r.output.strip().splitlines()) == 1, r.output
    assert f"{base}: the tokenizer has no chat template" in r.output
    assert "pass --chat-template FILE" in r.output and "known name: gemma" in r.output
    r = tokenize("--tokenizer", base, "--chat-template", "gemma", "-i", chats)
    assert r.exit_code == 0, r.output
    expected = tokenize("--tokenizer", own, "-i", chats)
    records = [json.loads(x) for x in r.stdout.splitlines()]
    assert [(x["input_ids"], x["loss_mask"]) for x in records] == [
        (x["input_ids"], x["loss_mask"]) for x in map(json.loads, expected.stdout.splitlines())]
    assert len(records) >= 5
    r = tokenize("--tokenizer", base, "--chat-template", "gemma3", "-i", chats)
    assert r.exit_code == 2 and "gemma3: no such file (nor a known chat template: gemma)" \
        in r.output


def test_truncation_is_reported(chats):
    r = tokenize("--tokenizer", chat_tokenizers.saved("smollm2"), "-i", chats,
                 "--max-length", 64)
    assert r.exit_code == 0, r.output
    lengths = [len(json.loads(x)["input_ids"]) for x in r.stdout.split("\n")[:-1]]
    assert max(lengths) == 64
    assert "truncated" in r.stderr and "no assistant token within --max-length" in r.stderr


@pytest.mark.parametrize("case", ["malformed", "empty", "missing", "tokenizer", "nothing left"])
def test_bad_input_one_error_line_no_output(case, chats, tmp_path):
    tok = chat_tokenizers.saved("smollm2")
    bad = tmp_path / "bad.jsonl"
    lines = chats.read_text().split("\n")
    inputs = {
        "malformed": (lines[0] + "\n" + "{nope\n", f"{bad}:2: not a chat record"),
        "empty": ("", f"{bad}: no chat records (empty input)"),
        "missing": (None, "missing.jsonl: no such file"),
        "tokenizer": (lines[0] + "\n", "nope.gguf: no such file or directory"),
        "nothing left": ('{"id": "q", "messages": [{"role": "user", "content": "hi"}]}\n',
                         "nothing written"),
    }
    text, message = inputs[case]
    if text is not None:
        bad.write_text(text)
    src = bad if text is not None else tmp_path / "missing.jsonl"
    out = tmp_path / "out" / "train.jsonl"
    r = tokenize("--tokenizer", tmp_path / "nope.gguf" if case == "tokenizer" else tok,
                 "-i", src, "-o", out)
    assert r.exit_code == 2 and message in r.stderr, r.output
    assert r.stderr.count("error:") == 1
    assert not out.exists()
    assert not out.parent.exists() or not any(out.parent.iterdir())  # no temporary left


def test_skip_invalid_counts(chats, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(chats.read_text().split("\n")[0] + "\n{nope\n")
    r = tokenize("--tokenizer", chat_tokenizers.saved("smollm2"), "-i", bad, "--skip-invalid")
    assert r.exit_code == 0, r.output
    assert len(r.stdout.split("\n")[:-1]) == 1
    assert "skipped 1 invalid: not a chat record" in r.stderr


def test_help_ends_with_a_runnable_example():
    r = runner.invoke(app, ["tokenize", "--help"])
    assert r.exit_code == 0 and "Example:" in r.stdout and "eagle3kit tokenize" in r.stdout


def test_no_torch_advice_on_stderr(smollm2_gguf, chats, tmp_path):
    """Without torch (no command needs it) transformers' "PyTorch was not found" advice is
    not printed by a command that loads a tokenizer (issue 24, item 11)."""
    import subprocess
    import sys

    hide_torch = ("import runpy, sys; sys.modules['torch'] = None; "
                  "sys.argv = ['eagle3kit'] + sys.argv[1:]; "
                  "runpy.run_module('eagle3kit', run_name='__main__')")
    p = subprocess.run([sys.executable, "-c", hide_torch, "tokenize", "--tokenizer",
                        str(smollm2_gguf), "-i", str(chats), "-o", str(tmp_path / "t.jsonl"),
                        "-j", "1"], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    assert "PyTorch" not in p.stderr and p.stderr.startswith("tokenizer "), p.stderr
