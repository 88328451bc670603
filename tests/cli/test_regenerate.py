"""`eagle3kit regenerate` through the CLI: real ShareGPT conversations answered by a tiny
random Llama that carries SmolLM2's real tokenizer and chat template (fp32, greedy), from
stdin and files; what the records say; resume after SIGKILL and SIGTERM; bad input.
"""

from __future__ import annotations

import collections
import os
import signal
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import msgspec
import pytest
from typer.testing import CliRunner

from eagle3kit.cli.app import app
from eagle3kit.core.sharding import make_mesh
from eagle3kit.data.chat import prompt_ids
from eagle3kit.data.records import ChatRecord, Message, RegeneratedRecord, encode
from eagle3kit.decode.conversations import plan
from eagle3kit.decode.engine import Engine, EngineConfig, Request
from eagle3kit.io.hf import load_target, resolve_target
from tests import assets
from tests.cli.chat_server import ChatServer

runner = CliRunner()
# fp32 and one device: the answers are exactly what the engine computes below
COMMON = ["--max-new-tokens", "12", "--max-context", "256", "--slots", "4",
          "--target-dtype", "float32", "--mesh", "data=1,tensor=1"]


def regenerate(*args, input=None):
    return runner.invoke(app, ["regenerate", *map(str, args)], input=input,
                         env={"COLUMNS": "250"})


def records(text: str | bytes) -> list[RegeneratedRecord]:
    data = text.encode() if isinstance(text, str) else text
    return [msgspec.json.decode(line, type=RegeneratedRecord) for line in data.splitlines()]


@pytest.fixture(scope="module")
def target():
    return assets.train_assets() / "target"


@pytest.fixture(scope="module")
def chats(tmp_path_factory):
    """10 real multi-turn ShareGPT conversations in the `mix` schema."""
    path = tmp_path_factory.mktemp("regen") / "chats.jsonl"
    path.write_bytes(b"".join(encode(c) for c in assets.sharegpt_chats(10)))
    return path


@pytest.fixture(scope="module")
def reference(target, chats, tmp_path_factory):
    """An uninterrupted run, from stdin to stdout."""
    r = regenerate("--target", target, *COMMON, input=chats.read_bytes())
    assert r.exit_code == 0, r.output
    return r.stdout_bytes


def test_records_are_the_targets_answers_in_the_conversations_context(target, chats,
                                                                       reference):
    tok = assets.smollm2_tokenizer()
    originals = [msgspec.json.decode(line, type=ChatRecord)
                 for line in chats.read_bytes().splitlines()]
    out = records(reference)
    written = {r.id for r in out}  # a first prompt longer than 256 tokens is dropped
    assert [r.id for r in out] == [c.id for c in originals if c.id in written]  # input order
    assert len(out) >= 8
    originals = [c for c in originals if c.id in written]
    ckpt = resolve_target(target)
    mesh = make_mesh("data=1,tensor=1", jax.devices()[:1])
    engine = Engine(ckpt.config, load_target(ckpt, mesh, jnp.float32), mesh,
                    [tok.eos_token_id], EngineConfig(rows=1, max_context=256))
    for orig, rec in zip(originals, out, strict=True):
        # system and user turns kept in place, every answerable assistant turn rewritten
        # (real ShareGPT has chats that open with an assistant message: nothing to answer)
        kept, _ = plan(orig.messages)
        assert [m.role for m in rec.messages] == [m.role for m in kept][: len(rec.messages)]
        for a, b in zip(kept, rec.messages, strict=False):
            if a.role != "assistant":
                assert a == b
        info = rec.generation
        assert (info.temperature, info.top_p, info.max_new_tokens, info.max_context) == (
            0.0, 1.0, 12, 256)
        answers = [i for i, m in enumerate(rec.messages) if m.role == "assistant"]
        assert len(info.turns) == len(answers) >= 1
        # turn j's prompt holds the regenerated answers of turns before it
        for j, at in enumerate(answers):
            ids = prompt_ids(tok, rec.messages[:at])
            assert info.turns[j].prompt_tokens == len(ids)
            assert info.turns[j].finish_reason in ("stop", "length")
            if j == 0 and orig is originals[0]:
                got = engine.generate([Request(0, ids, 12)])[0]
                assert info.turns[0].new_tokens == len(got.tokens)
                stop = [tok.eos_token_id]
                want = tok.decode([t for t in got.tokens if t not in stop],
                                  skip_special_tokens=True)
                assert rec.messages[at].content == want


def test_tokenize_reads_the_output_unchanged(target, reference, tmp_path):
    path = tmp_path / "regen.jsonl"
    path.write_bytes(reference)
    r = runner.invoke(app, ["tokenize", "-t", str(target), "-i", str(path), "-j", "1"])
    assert r.exit_code == 0, r.output
    assert len(r.stdout_bytes.splitlines()) == len(records(reference))


def test_from_a_file_to_a_file_equals_stdin_to_stdout(target, chats, reference, tmp_path):
    out = tmp_path / "out.jsonl"
    r = regenerate("--target", target, *COMMON, "-i", chats, "-o", out)
    assert r.exit_code == 0, r.output
    assert out.read_bytes() == reference
    again = regenerate("--target", target, *COMMON, "-i", chats, "-o", out)
    assert again.exit_code == 2 and "--resume" in again.output and "--force" in again.output
    # resuming a complete file does nothing; other settings are refused before any work
    same = regenerate("--target", target, *COMMON, "-i", chats, "-o", out, "--resume")
    assert same.exit_code == 0 and out.read_bytes() == reference, same.output
    other = regenerate("--target", target, *COMMON, "--seed", "1", "-i", chats, "-o", out,
                       "--resume")
    assert other.exit_code == 3 and "seed 0 -> 1" in other.output


def test_first_turn_only_and_dropping_truncated_answers(target, chats, reference):
    r = regenerate("--target", target, *COMMON, "--turns", "first", input=chats.read_bytes())
    assert r.exit_code == 0, r.output
    first = records(r.stdout_bytes)
    full = records(reference)
    for a, b in zip(first, full, strict=True):
        assert a.messages[-1].role == "assistant" and len(a.generation.turns) == 1
        # the first answer is the same whatever follows it
        assert a.messages == b.messages[: len(a.messages)]
    r = regenerate("--target", target, *COMMON, "--drop-truncated", input=chats.read_bytes())
    kept = records(r.stdout_bytes)
    cut = sum(any(t.finish_reason == "length" for t in x.generation.turns) for x in full)
    assert len(kept) == len(full) - cut
    assert f"{cut} an answer cut at --max-new-tokens (--drop-truncated)" in r.output


def test_shards_in_order_are_the_whole_run_byte_for_byte(target, chats, reference, tmp_path):
    """`--shard I/N` runs (one per GPU or host), concatenated in shard order, are the
    unsharded file, sampled: a repeated id keeps its place in the whole input's streams."""
    lines = chats.read_bytes().splitlines(keepends=True)
    again = next(x for x in lines if records(reference)[0].id.encode() in x)
    data = tmp_path / "in.jsonl"
    data.write_bytes(b"".join(lines) + again)  # 11 records: the repeat lands in shard 2/3
    sampled = ["--temperature", "0.9", "--seed", "5"]
    whole = regenerate("--target", target, *COMMON, *sampled, "-i", data)
    assert whole.exit_code == 0, whole.output
    parts = [regenerate("--target", target, *COMMON, *sampled, "-i", data, "--shard", f"{i}/3")
             for i in range(3)]
    assert [p.exit_code for p in parts] == [0, 0, 0]
    assert b"".join(p.stdout_bytes for p in parts) == whole.stdout_bytes
    out = records(whole.stdout_bytes)
    assert out[0].id == out[-1].id and out[0].messages != out[-1].messages  # two streams


def test_rows_split_over_data_devices_write_the_same_file(target, chats, reference):
    """`--mesh data=4` in one process (the rows over four devices) writes the one-device
    file byte for byte."""
    args = [a for a in COMMON if a not in ("--mesh", "data=1,tensor=1")]
    r = regenerate("--target", target, *args, "--mesh", "data=4,tensor=1",
                   input=chats.read_bytes())
    assert r.exit_code == 0, r.output
    assert "mesh {'data': 4, 'tensor': 1}" in r.output
    assert r.stdout_bytes == reference


def test_conversations_that_cannot_be_answered_are_counted_not_fatal(target):
    ok = ChatRecord("ok", "t", [Message("user", "Hi"), Message("assistant", "Hello")])
    no_user = ChatRecord("nouser", "t", [Message("assistant", "Welcome!")])
    too_long = ChatRecord("long", "t", [Message("user", "word " * 400),
                                        Message("assistant", "x")])
    # the second turn no longer fits: the conversation is kept up to the first answer
    late = ChatRecord("late", "t", [Message("user", "Hi"), Message("assistant", "a"),
                                    Message("user", "word " * 300), Message("assistant", "b")])
    data = b"".join(encode(c) for c in (no_user, ok, too_long, late))
    r = regenerate("--target", target, *COMMON, input=data)
    assert r.exit_code == 0, r.output
    assert [x.id for x in records(r.stdout_bytes)] == ["ok", "late"]
    assert len(records(r.stdout_bytes)[1].messages) == 2
    assert "1 no user turn to answer" in r.output
    assert "1 prompt longer than --max-context" in r.output
    assert "1 conversations end early" in r.output
    # nothing useful at all: an error, and no empty file left behind
    r = regenerate("--target", target, *COMMON, input=encode(no_user))
    assert r.exit_code == 2 and "no conversation could be regenerated" in r.output


def test_bad_input_gets_one_line(target, chats, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(chats.read_bytes() + b'{"messages": 3}\n')
    r = regenerate("--target", target, *COMMON, "-i", bad, "-o", tmp_path / "x.jsonl")
    assert r.exit_code == 2 and f"{bad}:11:" in r.output
    assert not (tmp_path / "x.jsonl").exists()  # refused before anything was written
    # a tokenizer without a chat template
    plain = tmp_path / "plain"
    plain.mkdir()
    for f in target.iterdir():
        if f.name != "chat_template.jinja":  # where transformers 5 saves the template
            (plain / f.name).write_bytes(f.read_bytes())
    r = regenerate("--target", plain, *COMMON, "-i", chats)
    assert r.exit_code == 2 and "no chat template" in r.output
    assert len(r.output.strip().splitlines()) == 1
    for args, words in ((["--turns", "some"], "--turns"), (["--top-p", "0"], "--top-p"),
                        (["--shard", "3/2"], "--shard"), (["--resume"], "-o FILE")):
        r = regenerate("--target", target, *COMMON, "-i", chats, *args)
        assert r.exit_code == 2 and words in r.output, args


def _start(target, chats, out, *extra):
    cmd = [sys.executable, "-m", "eagle3kit", "regenerate", "--target", str(target), *COMMON,
           "--slots", "1", "--sync-every", "1", "-i", str(chats), "-o", str(out), *extra]
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    return subprocess.Popen(cmd, stderr=subprocess.PIPE, env=env)


def _wait_for_lines(proc, out, n=1, timeout=240):
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if out.exists() and out.read_bytes().count(b"\n") >= n:
            return
        assert proc.poll() is None, proc.stderr.read().decode()
        time.sleep(0.02)
    raise AssertionError("no record written in time")


@pytest.mark.slow
def test_sigkill_then_resume_equals_an_uninterrupted_run(target, chats, reference, tmp_path):
    """A real process killed with SIGKILL after its first record (with a torn line added, as
    a kill inside a write leaves) resumes to the uninterrupted run's file, byte for byte."""
    out = tmp_path / "out.jsonl"
    proc = _start(target, chats, out)
    _wait_for_lines(proc, out)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    written = out.read_bytes().count(b"\n")
    assert 1 <= written < 10
    with open(out, "ab") as f:
        f.write(b'{"id": "torn')
    r = regenerate("--target", target, *COMMON, "-i", chats, "-o", out, "--resume")
    assert r.exit_code == 0, r.output
    assert f"{written} already in the output" in r.output
    assert out.read_bytes() == reference


@pytest.mark.slow
def test_sigterm_stops_with_exit_75_and_resumes(target, chats, reference, tmp_path):
    out = tmp_path / "out.jsonl"
    proc = _start(target, chats, out)
    _wait_for_lines(proc, out)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 75, err.decode()
    assert "SIGTERM" in err.decode() and "--resume" in err.decode()
    kept = records(out.read_bytes())
    assert 1 <= len(kept) < 10
    ids = collections.Counter(x.id for x in kept)
    r = regenerate("--target", target, *COMMON, "-i", chats, "-o", out, "--resume")
    assert r.exit_code == 0, r.output
    assert out.read_bytes() == reference and max(ids.values()) == 1


# ---- --endpoint: an OpenAI-compatible server on 127.0.0.1 --------------------------------------


def endpoint_run(server_url, chats, *args):
    return regenerate("--target", "tiny-chat", "--endpoint", server_url, "--concurrency", "3",
                      "--retries", "2", "--timeout", "10", "-i", chats, *args)


def test_endpoint_answers_each_turn_in_context(chats):
    with ChatServer(flaky=4) as server:  # every 4th request fails once: retried
        r = endpoint_run(server.url, chats, "--no-thinking")
    assert r.exit_code == 0, r.output
    assert len(server.failed) >= 3  # the retries were really needed
    out = records(r.stdout_bytes)
    originals = [msgspec.json.decode(line, type=ChatRecord)
                 for line in chats.read_bytes().splitlines()]
    assert [x.id for x in out] == [c.id for c in originals]
    for rec in out:
        answers = [m.content for m in rec.messages if m.role == "assistant"]
        assert answers and all(a.startswith("re ") for a in answers)
        assert [f"turn {j}" in a for j, a in enumerate(answers)] == [True] * len(answers)
        assert rec.generation.target == "tiny-chat"
    # a later turn was asked with the server's own earlier answer, in thinking-off mode
    later = [b for b in server.bodies if sum(m["role"] == "assistant" for m in b["messages"])]
    assert later and all(b["chat_template_kwargs"] == {"enable_thinking": False}
                         for b in server.bodies)
    first_answers = {m["content"] for b in later for m in b["messages"]
                     if m["role"] == "assistant"}
    assert first_answers <= {m.content for x in out for m in x.messages}


def test_endpoint_refusals_are_counted_and_an_outage_is_resumable(chats, tmp_path):
    refused = ChatRecord("refused", "t", [Message("user", "TOOLONG " * 3),
                                          Message("assistant", "x")])
    data = tmp_path / "in.jsonl"
    data.write_bytes(encode(refused) + chats.read_bytes())
    with ChatServer() as server:
        full = endpoint_run(server.url, data)
    assert full.exit_code == 0, full.output
    assert "1 refused by the server (prompt is too long)" in full.output
    out = tmp_path / "out.jsonl"
    first_two = sum(len(plan(c.messages)[1]) for c in records(full.stdout_bytes)[:2])
    with ChatServer(up_for=first_two + 1) as server:  # goes down after two conversations
        r = endpoint_run(server.url, data, "-o", out, "--concurrency", "1")
    assert r.exit_code == 4 and "--resume" in r.output and "down for maintenance" in r.output
    assert 2 <= out.read_bytes().count(b"\n") < len(records(full.stdout_bytes))
    with ChatServer() as server:
        r = endpoint_run(server.url, data, "-o", out, "--resume")
    assert r.exit_code == 0, r.output
    assert out.read_bytes() == full.stdout_bytes


def test_an_unreachable_endpoint_fails_in_seconds(chats):
    t0 = time.monotonic()
    r = regenerate("--target", "x", "--endpoint", "http://127.0.0.1:9", "--retries", "1",
                   "-i", chats)
    assert r.exit_code == 4 and "127.0.0.1:9" in r.output
    assert len(r.output.strip().splitlines()) == 1 and time.monotonic() - t0 < 10
