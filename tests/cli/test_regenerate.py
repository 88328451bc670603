"""`eagle3kit regenerate` through the CLI: real ShareGPT conversations answered by a tiny
random Llama that carries SmolLM2's real tokenizer and chat template (fp32, greedy), from
stdin and files; what the records say; resume after SIGKILL and SIGTERM; bad input.
"""

from __future__ import annotations

import collections
import re
import signal
import time
import zlib

import jax
import jax.numpy as jnp
import msgspec
import pytest
from typer.testing import CliRunner

from eagle3kit.cli.app import app
from eagle3kit.core.sharding import make_mesh
from eagle3kit.core.target import unstack_in_place
from eagle3kit.data.chat import prompt_ids
from eagle3kit.data.records import ChatRecord, Message, RegeneratedRecord, encode
from eagle3kit.decode.conversations import plan
from eagle3kit.decode.engine import Engine, EngineConfig, Request, Sampling
from eagle3kit.io.hf import load_target, resolve_target
from tests import assets, warm_cli
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
    # the CLI's weights layout and engine shape (4 rows: --slots 4), so this engine runs the
    # programs the CLI runs compiled, not programs of its own
    engine = Engine(ckpt.config, unstack_in_place(load_target(ckpt, mesh, jnp.float32),
                                                  ckpt.config),
                    mesh, [tok.eos_token_id], EngineConfig(rows=4, max_context=256))
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
    assert "(mesh data=1,tensor=1;" in r.output, r.output  # as --mesh is written
    again = regenerate("--target", target, *COMMON, "-i", chats, "-o", out)
    assert again.exit_code == 2 and "--resume" in again.output and "--force" in again.output
    # resuming a complete file does nothing; other settings are refused before any work
    same = regenerate("--target", target, *COMMON, "-i", chats, "-o", out, "--resume")
    assert same.exit_code == 0 and out.read_bytes() == reference, same.output
    other = regenerate("--target", target, *COMMON, "--seed", "1", "-i", chats, "-o", out,
                       "--resume")
    assert other.exit_code == 3 and "seed 0 -> 1" in other.output


@pytest.fixture(scope="module")
def first_turns(target, chats):
    """The run of the first turns alone."""
    r = regenerate("--target", target, *COMMON, "--turns", "first", input=chats.read_bytes())
    assert r.exit_code == 0, r.output
    return r.stdout_bytes


def test_first_turn_only_and_dropping_truncated_answers(target, chats, reference, first_turns):
    first = records(first_turns)
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


def test_rows_split_over_data_devices_write_the_same_file(target, chats, reference,
                                                         first_turns):
    """`--mesh data=4` in one process (the rows over four devices) writes the one-device
    file byte for byte."""
    args = [a for a in COMMON if a not in ("--mesh", "data=1,tensor=1")]
    r = regenerate("--target", target, *args, "--mesh", "data=4,tensor=1",
                   input=chats.read_bytes())
    assert r.exit_code == 0, r.output
    assert "mesh data=4,tensor=1" in r.output
    assert r.stdout_bytes == reference
    # fewer conversations than data devices: the cache sized to the work rounds its rows up
    # to the data axis (two first turns on four devices) and answers as one device does (the
    # first two records of the one-device run of every first turn)
    first = [a for a in args if a not in ("--slots", "4")] + ["--turns", "first", "--limit", "2"]
    four = regenerate("--target", target, *first, "--mesh", "data=4,tensor=1",
                      input=chats.read_bytes())
    assert four.exit_code == 0, four.output
    assert "4 slots x " in four.output
    assert len(records(four.stdout_bytes)) == 2
    assert four.stdout_bytes == b"".join(first_turns.splitlines(keepends=True)[:2])


def test_the_ragged_kernel_writes_the_same_answers(target, chats, reference):
    """`--kv-attention pallas` reads each row's keys in place (interpret mode on a CPU): the
    same records as the window path's; on a mesh it is refused in one line."""
    r = regenerate("--target", target, *COMMON, "--kv-attention", "pallas", "--limit", "2",
                   input=chats.read_bytes())
    assert r.exit_code == 0, r.output
    assert " GiB, read by the ragged kernel)" in r.output
    got = records(r.stdout_bytes)
    assert len(got) == 2 and got == records(reference)[:2]
    args = [a for a in COMMON if a not in ("--mesh", "data=1,tensor=1")]
    for extra, words in ((["--mesh", "data=2,tensor=1"], "run one process per GPU with "
                          "--shard I/N"), (["--mesh", "data=1,tensor=1", "--kv-attention",
                                            "flash"], "--kv-attention 'flash'")):
        r = regenerate("--target", target, *args, "--kv-attention", "pallas", *extra,
                       input=chats.read_bytes())
        assert r.exit_code == 2 and words in r.output, r.output
        assert len(r.output.strip().splitlines()) == 1


def test_prompts_riding_in_decode_steps_write_the_same_file(target, chats, reference,
                                                           monkeypatch):
    """`--mixed-budget 64` reaches the engine (prompts ride in the decode steps of the rows
    that decode, decode/mixed.py; here every row's answer has 12 tokens, so rows finish
    together and refills find none decoding: tests/decode/test_mixed.py has rows that do),
    and the records are the same byte for byte. A budget that is no whole number of pieces,
    or rows over several data ways, are refused in one line."""
    from eagle3kit.decode.engine import Engine

    init, budgets = Engine.__init__, []

    def spy(self, tcfg, weights, mesh, stops, cfg, speculation=None):
        budgets.append((cfg.mixed_budget, cfg.mixed_piece))
        init(self, tcfg, weights, mesh, stops, cfg, speculation)

    monkeypatch.setattr(Engine, "__init__", spy)
    r = regenerate("--target", target, *COMMON, "--mixed-budget", 64, input=chats.read_bytes())
    assert r.exit_code == 0, r.output
    assert r.stdout_bytes == reference
    assert budgets == [(64, 64)]
    args = [a for a in COMMON if a not in ("--mesh", "data=1,tensor=1")]
    for extra, words in ((["--mixed-budget", 100], "--mixed-budget 100: a multiple of 64"),
                         (["--mixed-budget", 64, "--mesh", "data=2,tensor=1"],
                          "one data-parallel way, not 2")):
        r = regenerate("--target", target, *args, *extra, input=chats.read_bytes())
        assert r.exit_code == 2 and words in r.output, r.output
        assert len(r.output.strip().splitlines()) == 1


def test_a_conversation_that_outgrows_the_context_keeps_its_answers(target):
    """A conversation that outgrows --max-context mid-way: its first answer is cut where the
    context ends (finish reason `length`, as many tokens as the row had left), its next
    turn cannot be asked, and the record keeps the conversation up to that answer, counted
    as ended early."""
    chat = ChatRecord("grows", "t", [Message("user", "Hi"), Message("assistant", "a"),
                                     Message("user", "And?"), Message("assistant", "b")])
    args = [a for a in COMMON if a not in ("--max-context", "256")]
    r = regenerate("--target", target, *args, "--max-context", 256, input=encode(chat))
    first = records(r.stdout_bytes)[0].generation.turns[0]
    assert first.new_tokens == 12  # room to spare: --max-new-tokens ends it
    context = first.prompt_tokens + 5
    r = regenerate("--target", target, *args, "--max-context", context, input=encode(chat))
    assert r.exit_code == 0, r.output
    (got,) = records(r.stdout_bytes)
    assert [m.role for m in got.messages] == ["user", "assistant"]
    (turn,) = got.generation.turns
    assert (turn.finish_reason, turn.new_tokens) == ("length", 5)
    assert "1 conversation ends early" in r.output and "prompt longer than --max-context" \
        in r.output


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
    one = regenerate("--target", target, *COMMON, input=encode(ok))
    assert "1 conversation read: 1 written; 1 answer (" in one.output, one.output
    assert "1 no user turn to answer" in r.output
    assert "1 prompt longer than --max-context" in r.output
    assert "1 conversation ends early" in r.output
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
    assert "pass --chat-template FILE" in r.output and "known name: gemma" in r.output
    assert len(r.output.strip().splitlines()) == 1
    for args, words in ((["--turns", "some"], "--turns"), (["--top-p", "0"], "--top-p"),
                        (["--shard", "3/2"], "--shard"), (["--resume"], "-o FILE"),
                        (["--chat-template", "nope"], "nope: no such file (nor a known chat "
                         "template: gemma)"),
                        (["--chat-template", "gemma", "--endpoint", "http://127.0.0.1:9"],
                         "with --endpoint the server applies its own template")):
        r = regenerate("--target", target, *COMMON, "-i", chats, *args)
        assert r.exit_code == 2 and words in r.output, args


def _start(server, args: list) -> warm_cli.Command:
    """`eagle3kit ARGS` as a real process of its own (forked from the session's server: no
    fresh interpreter's seconds of imports), its stderr a pipe."""
    return warm_cli.Command(server.sock, args, env=server.env, stderr=warm_cli.PIPE)


def _regenerate(server, target, chats, out, *extra) -> warm_cli.Command:
    return _start(server, ["regenerate", "--target", target, *COMMON, "--slots", "1",
                           "--sync-every", "1", "-i", chats, "-o", out, *extra])


def _wait_for_lines(proc, out, n=1, timeout=240):
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if out.exists() and out.read_bytes().count(b"\n") >= n:
            return
        assert proc.poll() is None, proc.stderr.read().decode()
        time.sleep(0.02)
    raise AssertionError("no record written in time")


@pytest.mark.slow
def test_sigkill_then_resume_equals_an_uninterrupted_run(target, chats, reference,
                                                         eagle3kit_server, tmp_path):
    """A real process killed with SIGKILL after its first record (with a torn line added, as
    a kill inside a write leaves) resumes to the uninterrupted run's file, byte for byte."""
    out = tmp_path / "out.jsonl"
    partial = tmp_path / "out.jsonl.partial"  # records go there until the run is complete
    proc = _regenerate(eagle3kit_server, target, chats, out)
    _wait_for_lines(proc, partial)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    written = partial.read_bytes().count(b"\n")
    assert 1 <= written < 10 and not out.exists()
    with open(partial, "ab") as f:
        f.write(b'{"id": "torn')
    r = regenerate("--target", target, *COMMON, "-i", chats, "-o", out, "--resume")
    assert r.exit_code == 0, r.output
    assert f"{written} already in the output" in r.output
    assert out.read_bytes() == reference and not partial.exists()


@pytest.mark.slow
def test_sigterm_stops_with_exit_75_and_resumes(target, chats, reference, eagle3kit_server,
                                                tmp_path):
    out = tmp_path / "out.jsonl"
    partial = tmp_path / "out.jsonl.partial"
    proc = _regenerate(eagle3kit_server, target, chats, out)
    _wait_for_lines(proc, partial)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 75, err.decode()
    assert "SIGTERM" in err.decode() and "--resume" in err.decode()
    assert "stopping at the next sync, keeping every record written" in err.decode()
    assert "checkpoint" not in err.decode()  # regenerate has none
    kept = records(partial.read_bytes())
    assert 1 <= len(kept) < 10
    # nothing under the asked name: `tokenize -i out.jsonl` cannot take a part for the whole
    assert not out.exists()
    again = regenerate("--target", target, *COMMON, "-i", chats, "-o", out)
    assert again.exit_code == 2 and "out.jsonl.partial: the records of an interrupted run; " \
        "pass --resume" in again.output, again.output
    ids = collections.Counter(x.id for x in kept)
    r = regenerate("--target", target, *COMMON, "-i", chats, "-o", out, "--resume")
    assert r.exit_code == 0, r.output
    assert out.read_bytes() == reference and max(ids.values()) == 1
    assert not partial.exists()


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
    assert r.exit_code == 4 and "down for maintenance" in r.output
    assert f"the records written so far are kept in {out}.partial: --resume" in r.output
    # a file under the asked name is complete: the part is kept beside it (issue 39)
    partial = tmp_path / "out.jsonl.partial"
    assert not out.exists()
    assert 2 <= partial.read_bytes().count(b"\n") < len(records(full.stdout_bytes))
    with ChatServer() as server:
        r = endpoint_run(server.url, data, "-o", out, "--resume")
    assert r.exit_code == 0, r.output
    assert out.read_bytes() == full.stdout_bytes and not partial.exists()


def test_an_unreachable_endpoint_fails_in_seconds(chats):
    t0 = time.monotonic()
    r = regenerate("--target", "x", "--endpoint", "http://127.0.0.1:9", "--retries", "1",
                   "-i", chats)
    assert r.exit_code == 4 and "127.0.0.1:9" in r.output
    assert len(r.output.strip().splitlines()) == 1 and time.monotonic() - t0 < 10


@pytest.fixture(scope="module")
def endpoint_reference(chats):
    """An uninterrupted --endpoint run over `chats`, from a server that never fails."""
    with ChatServer() as server:
        r = endpoint_run(server.url, chats)
    assert r.exit_code == 0, r.output
    return r.stdout_bytes


def test_endpoint_resume_cuts_a_torn_last_line_and_continues_byte_for_byte(
        chats, endpoint_reference, tmp_path):
    """A kill inside a write leaves part of a record after the last newline: --resume cuts
    it off (the file never keeps half a record) and writes the rest, so the file ends up
    byte for byte the uninterrupted run's."""
    lines = endpoint_reference.splitlines(keepends=True)
    out = tmp_path / "out.jsonl"
    out.write_bytes(b"".join(lines[:3]) + lines[3][: len(lines[3]) // 2])
    with ChatServer() as server:
        r = endpoint_run(server.url, chats, "-o", out, "--resume")
    assert r.exit_code == 0, r.output
    assert "3 already in the output" in r.output
    assert out.read_bytes() == endpoint_reference


def test_endpoint_shards_are_blocks_that_cat_back_to_the_whole_run(chats, endpoint_reference):
    """--shard I/N over 10 conversations, N = 3 and 4 (neither divides 10): every
    conversation is written by exactly one shard, and `cat` of the N outputs in order is the
    unsharded run."""
    with ChatServer() as server:
        for n in (3, 4):
            parts = [endpoint_run(server.url, chats, "--shard", f"{i}/{n}") for i in range(n)]
            assert [p.exit_code for p in parts] == [0] * n, [p.output for p in parts]
            assert b"".join(p.stdout_bytes for p in parts) == endpoint_reference, n


def test_endpoint_rate_limits_are_retried_not_refused(chats, endpoint_reference):
    """HTTP 429 (rate limited) on the first attempt of every other request: each is retried
    and answered, so nothing is dropped or cut and the output is the unthrottled run's."""
    with ChatServer(flaky=2, fail_code=429) as server:
        r = endpoint_run(server.url, chats, "--concurrency", "10")
    assert r.exit_code == 0, r.output
    assert len(server.failed) >= 5
    assert r.stdout_bytes == endpoint_reference


def test_endpoint_retries_n_means_n_plus_one_attempts(tmp_path):
    """--retries 2 against a server that is down: the request is sent 3 times (the attempt
    and 2 retries), then the run stops with exit 4."""
    data = tmp_path / "in.jsonl"
    data.write_bytes(encode(ChatRecord("one", "t", [Message("user", "Hi"),
                                                    Message("assistant", "Hello")])))
    with ChatServer(up_for=0) as server:
        r = endpoint_run(server.url, data, "--retries", "2")
    assert r.exit_code == 4 and "after 2 retries" in r.output, r.output
    assert server.calls == 3
    # to a file: no record was made, so none is said to be kept, and no file is left
    with ChatServer(up_for=0) as server:
        r = endpoint_run(server.url, data, "--retries", "0", "-o", tmp_path / "out.jsonl")
    assert r.exit_code == 4 and "kept" not in r.output, r.output
    assert list(tmp_path.iterdir()) == [data]


def test_endpoint_records_reach_the_file_as_they_finish_and_survive_sigkill(eagle3kit_server,
                                                                            tmp_path):
    """A real process, one conversation at a time: while the server holds the third
    conversation's request, the first two records are already in the file (written through
    at once, not at the next periodic fsync), a SIGKILL keeps them, and --resume completes
    the uninterrupted run's bytes."""
    data = tmp_path / "in.jsonl"
    data.write_bytes(b"".join(
        encode(ChatRecord(f"c{i}", "t", [Message("user", f"question {i}"),
                                         Message("assistant", "old answer")]))
        for i in range(4)))
    with ChatServer() as server:
        full = endpoint_run(server.url, data)
    assert full.exit_code == 0, full.output
    out = tmp_path / "out.jsonl"
    partial = tmp_path / "out.jsonl.partial"
    with ChatServer(hold_after=2) as server:
        proc = _start(eagle3kit_server, ["regenerate", "--target", "tiny-chat", "--endpoint",
                                         server.url, "--concurrency", "1", "-i", data, "-o",
                                         out])
        try:
            assert server.held.wait(60), proc.stderr.read().decode()
            _wait_for_lines(proc, partial, 2, timeout=10)
        finally:
            proc.kill()
            proc.wait()
    lines = full.stdout_bytes.splitlines(keepends=True)
    assert partial.read_bytes() == b"".join(lines[:2]) and not out.exists()
    with ChatServer() as server:
        r = endpoint_run(server.url, data, "-o", out, "--resume")
    assert r.exit_code == 0, r.output
    assert out.read_bytes() == full.stdout_bytes


# ---- several samples per conversation, sampling settings, repetition -------------------------

# sampled as the shards test above samples (its programs, compiled once for the module)
SAMPLED = [*COMMON, "--temperature", "0.9"]
# the tiny random model's greedy answers repeat one token from the start; sampled among its two
# most probable tokens, some answers fall into a loop of the rule below and some do not (top-k
# only here: on a CPU, XLA sorts the whole vocabulary for it at every step of the loop)
TOP2 = [*COMMON, "--temperature", "1", "--top-k", "2", "--sync-every", "12"]
LOOPS = ["--repeat-copies", "3", "--repeat-min-tokens", "5", "--repeat-max-block", "2"]


def made(out: list[RegeneratedRecord]) -> list[tuple]:
    """What was generated, without the settings."""
    return [(x.id, x.messages, x.generation.turns) for x in out]


def by_source(out: list[RegeneratedRecord]) -> dict[str, list[RegeneratedRecord]]:
    groups = collections.defaultdict(list)
    for r in out:
        groups[r.id.rsplit("#s", 1)[0]].append(r)
    return groups


def test_samples_are_distinct_answers_with_traceable_ids_and_reproducible_seeds(target, chats):
    from eagle3kit.jobs.regen_work import request_seed

    one = records(regenerate("--target", target, *SAMPLED, "--limit", 3,
                             input=chats.read_bytes()).stdout_bytes)
    r = regenerate("--target", target, *SAMPLED, "--limit", 3, "--samples", 3,
                   input=chats.read_bytes())
    assert r.exit_code == 0, r.output
    three = records(r.stdout_bytes)
    assert [x.id for x in three] == [f"{x.id}#s{k}" for x in one for k in range(3)]
    assert f"(3 samples each): {3 * len(one)} written" in r.output
    for x, group in zip(one, by_source(three).values(), strict=True):
        assert [s.generation.sample for s in group] == [0, 1, 2]
        assert all(s.generation.samples == 3 and s.source == x.source for s in group)
        # sample 0 is the one-sample run's answer (the same seeds give the same streams, in
        # another batch), the others are new ones
        assert (group[0].messages, group[0].generation.turns) == (x.messages,
                                                                 x.generation.turns)
        assert len({tuple(s.messages) for s in group}) == 3
        for k, s in enumerate(group):
            assert [t.seed for t in s.generation.turns] == [
                request_seed(x.id, 0, j, k) for j in range(len(s.generation.turns))]
    # ... and that one answer is the single-answer stream runs have always drawn from: each
    # turn's seed a hash of the input id, its occurrence and the turn alone (so a file
    # regenerated with one sample stays what it was, and --samples N extends it), the first
    # answer the engine's for that seed in the CLI's shape (its programs)
    x, occurrence = one[0], 0
    assert [t.seed for t in x.generation.turns] == [
        zlib.crc32(f"{x.id}\0{occurrence}\0{j}".encode())
        for j in range(len(x.generation.turns))]
    tok, ckpt = assets.smollm2_tokenizer(), resolve_target(target)
    mesh = make_mesh("data=1,tensor=1", jax.devices()[:1])
    engine = Engine(ckpt.config, unstack_in_place(load_target(ckpt, mesh, jnp.float32),
                                                  ckpt.config),
                    mesh, [tok.eos_token_id], EngineConfig(
                        rows=4, max_context=256, sampling=Sampling(0.9)))
    at = next(i for i, m in enumerate(x.messages) if m.role == "assistant")
    got = engine.generate([Request(0, prompt_ids(tok, x.messages[:at]), 12,
                                   x.generation.turns[0].seed)])[0]
    assert x.messages[at].content == tok.decode(
        [t for t in got.tokens if t != tok.eos_token_id], skip_special_tokens=True)


def test_turns_and_samples_that_keep_their_rows_write_the_run_from_scratch(
        target, chats, reference, monkeypatch):
    """A conversation's next turn extends the row that answered the last one, and its
    samples copy the row that prefilled their first prompt (decode/prefixes.py): the file is
    byte for byte the one of prefilling every prompt whole (fp32), greedy and sampled."""
    from eagle3kit.decode.prefixes import Prefixes

    place, held = Prefixes.place, []

    def spy(self, share, prompt, free, skip):
        row, source, n = place(self, share, prompt, free, skip)
        held.append((n, source is not None))
        return row, source, n

    monkeypatch.setattr(Prefixes, "place", spy)
    args = ["--target", target, *SAMPLED, "--samples", 2, "--limit", 4]
    sampled = regenerate(*args, input=chats.read_bytes())
    assert sampled.exit_code == 0, sampled.output
    assert sum(n for n, _ in held) > 0 and any(copied for _, copied in held)
    monkeypatch.setattr(Prefixes, "place", lambda self, share, prompt, free, skip: place(
        self, None, prompt, free, skip))  # every prompt prefilled whole
    whole = regenerate("--target", target, *COMMON, input=chats.read_bytes())
    assert whole.exit_code == 0, whole.output
    assert whole.stdout_bytes == reference
    assert regenerate(*args, input=chats.read_bytes()).stdout_bytes == sampled.stdout_bytes
    assert len(records(sampled.stdout_bytes)) >= 6


def test_shards_and_resume_with_samples_give_the_unsharded_run(target, chats, tmp_path):
    full = tmp_path / "full.jsonl"
    args = ["--target", target, *SAMPLED, "--samples", 2, "--limit", 5, "--turns", "first",
            "-i", chats]
    r = regenerate(*args, "-o", full)
    assert r.exit_code == 0, r.output
    lines = full.read_bytes().splitlines(keepends=True)
    assert len(lines) >= 8
    shards = []
    for i in range(2):
        out = tmp_path / f"shard{i}.jsonl"
        assert regenerate(*args, "--shard", f"{i}/2", "-o", out).exit_code == 0
        shards.append(out.read_bytes())
    assert shards[0] and shards[1] and b"".join(shards) == full.read_bytes()
    # killed after three records (the third a sample #s0 or #s1), a torn fourth
    part = tmp_path / "part.jsonl"
    part.write_bytes(b"".join(lines[:3]) + lines[3][:25])
    r = regenerate(*args, "-o", part, "--resume")
    assert r.exit_code == 0 and "3 already in the output" in r.output, r.output
    assert part.read_bytes() == full.read_bytes()
    r = regenerate(*args[:-2], "--samples", 3, "-i", chats, "-o", part, "--resume")
    assert r.exit_code == 3 and "samples 2 -> 3" in r.output


def test_a_loop_is_its_own_finish_reason_kept_or_dropped(target, chats):
    run = ["--target", target, *TOP2, *LOOPS, "--limit", 6]
    r = regenerate(*run, input=chats.read_bytes())
    assert r.exit_code == 0, r.output
    kept = records(r.stdout_bytes)
    reasons = collections.Counter(t.finish_reason for x in kept for t in x.generation.turns)
    assert reasons["repetition"] >= 3 and reasons["length"] >= 3, reasons
    assert f"{reasons['repetition']} repetition" in r.output  # the summary counts them
    assert all(t.new_tokens < 12 for x in kept for t in x.generation.turns
               if t.finish_reason == "repetition")
    assert kept[0].generation.repetition.copies == 3
    # unchecked: the same streams run to the limit
    free = records(regenerate("--target", target, *TOP2, "--limit", 6,
                              input=chats.read_bytes()).stdout_bytes)
    assert all(t.finish_reason != "repetition" for x in free for t in x.generation.turns)
    assert free[0].generation.repetition.copies == 3  # the default rule, no loop within 12
    for a, b in zip(kept, free, strict=True):
        first = a.generation.turns[0]
        if first.finish_reason != "repetition":
            assert a.messages[:2] == b.messages[:2] and a.generation.turns[0] == \
                b.generation.turns[0]

    def looped(x):
        return next((j for j, t in enumerate(x.generation.turns)
                     if t.finish_reason == "repetition"), None)

    r = regenerate(*run, "--on-repetition", "drop-conversation", input=chats.read_bytes())
    assert made(records(r.stdout_bytes)) == made([x for x in kept if looped(x) is None])
    n = sum(looped(x) is not None for x in kept)
    assert f"{n} a looping answer (--on-repetition drop-conversation)" in r.output
    # drop-answer: each conversation ends before its first looping answer
    r = regenerate(*run, "--on-repetition", "drop-answer", input=chats.read_bytes())
    want = []
    for x in kept:
        j = looped(x)
        if j is None:
            want += made([x])
        elif j > 0:
            answers = [i for i, m in enumerate(x.messages) if m.role == "assistant"]
            want.append((x.id, x.messages[: answers[j - 1] + 1], x.generation.turns[:j]))
    assert made(records(r.stdout_bytes)) == want
    assert "a looping answer dropped (--on-repetition drop-answer)" in r.output


def test_bad_sampling_and_repetition_options_get_one_line(target, chats, tmp_path):
    out = tmp_path / "x.jsonl"
    for args, words in ((["--samples", "0"], "--samples 0"),
                        (["--samples", "-2"], "--samples -2"),
                        (["--samples", "2"], "--temperature"),
                        (["--top-k", "-1"], "--top-k"),
                        (["--on-repetition", "skip"], "--on-repetition"),
                        (["--repeat-copies", "1"], "--repeat-copies"),
                        (["--endpoint", "http://127.0.0.1:9", "--on-repetition",
                          "drop-answer"], "--on-repetition")):
        r = regenerate("--target", target, *COMMON, "-i", chats, "-o", out, *args)
        assert r.exit_code == 2 and words in r.output, (args, r.output)
        assert r.output.strip().startswith("error:") and len(r.output.strip().splitlines()) == 1
        assert not out.exists()


def test_progress_lines_in_a_log(target, chats, reference, monkeypatch):
    """stderr is a log (not a terminal), a line per update: none says `0 tokens` (the first
    conversation here is dropped before any token exists), the counts only grow, and the last
    conversation's line comes once, with every token the summary counts (it was printed
    twice, the first one short)."""
    from eagle3kit.jobs import regenerate as job

    monkeypatch.setattr(job, "PROGRESS_SECONDS", 0.0)
    unanswerable = ChatRecord(id="none", messages=[Message("assistant", "no user turn")])
    r = regenerate("--target", target, *COMMON, input=encode(unanswerable) + chats.read_bytes())
    assert r.exit_code == 0 and r.stdout_bytes == reference, r.output
    lines = [x.split() for x in r.stderr.splitlines() if re.match(r"regenerate \d", x)]
    assert lines[0][:2] == ["regenerate", "1/11"] and "tokens" not in lines[0], r.stderr
    assert " 0 tokens" not in r.stderr, r.stderr
    progress = [(int(x[1].split("/")[0]), int(x[2].replace(",", ""))) for x in lines[1:]]
    assert progress == sorted(set(progress)), r.stderr  # growing, no line twice
    done = [d for d, _ in progress]
    assert done.count(done[-1]) == 1 and lines[-1][1] == "11/11", r.stderr
    summary = r.stderr.splitlines()[-1]
    assert f"; {progress[-1][1]:,} tokens " in summary, r.stderr
    assert "eta" not in lines[-1], r.stderr  # nothing left to wait for


def test_the_cache_is_sized_to_the_work_and_what_cannot_fit_exits_4(target, tmp_path,
                                                                    monkeypatch):
    """The KV cache holds no more rows than conversations and no more positions than the
    longest prompt plus --max-new-tokens (issue 39, item 6: the defaults, 64 slots x 4096
    positions, were killed on a CPU for two conversations). What cannot fit, against the free
    memory (capped by EAGLE3KIT_DEVICE_MEMORY, and on a CPU the host's available memory), is
    one line, exit 4, the flags to lower, no output file."""
    data = tmp_path / "in.jsonl"  # prompts of 129-252 tokens: 256 positions, as COMMON's
    data.write_bytes(b"".join(encode(ChatRecord(str(i), "t", [
        Message("user", "Tell me about the weather " * 20), Message("assistant", "Hello")]))
        for i in range(4)))
    out = tmp_path / "x.jsonl"
    args = ["--target", target, "-i", data, "-o", out, "--max-new-tokens", "4",
            "--max-context", "256", "--target-dtype", "float32", "--mesh", "data=1,tensor=1",
            "--slots", "512"]
    # four conversations: 4 rows x 256 positions fit 8 MiB, 512 x 256 did not
    r = runner.invoke(app, ["regenerate", *map(str, args)],
                      env={"COLUMNS": "250", "EAGLE3KIT_DEVICE_MEMORY": "8M"})
    assert r.exit_code == 0, r.output
    assert "4 slots x 256 positions" in r.output and len(records(out.read_bytes())) == 4
    out.unlink()
    # refused before the weights load (minutes for a large target), not after
    from eagle3kit.io import hf

    def no_weights(*args, **kwargs):
        raise AssertionError("the weights loaded before the memory check")

    monkeypatch.setattr(hf, "load_target", no_weights)
    r = runner.invoke(app, ["regenerate", *map(str, args)],
                      env={"COLUMNS": "250", "EAGLE3KIT_DEVICE_MEMORY": "16K"})
    assert r.exit_code == 4, r.output
    line = r.output.strip()
    assert line.startswith("error: out of device memory for --slots 512 x --max-context 256 "
                           "(4 x 256 for this input): "), line
    assert "lower --slots or --max-context" in line and len(line.splitlines()) == 1
    assert not out.exists() and not (tmp_path / "x.jsonl.partial").exists()
    # a CPU reports no device memory: the host's available memory is what a cache can take
    from eagle3kit.decode import engine

    monkeypatch.setattr(engine, "host_available_bytes", lambda: 16 * 1024)
    r = runner.invoke(app, ["regenerate", *map(str, args)], env={"COLUMNS": "250"})
    assert r.exit_code == 4 and "more than the 0.00 GiB free" in r.output, r.output
    assert not out.exists()
