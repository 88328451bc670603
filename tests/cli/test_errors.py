"""Every command's error path with odd file names: `[x]` (Rich markup), `:-1:` (an emoji code),
spaces and unicode come back exactly as given, in one `error:` line, with nothing written."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from eagle3kit.cli.app import app
from tests import assets

runner = CliRunner()
ODD = ["missing[bold].jsonl", "a[/x]b.jsonl", "f:-1:.jsonl", "with space é.jsonl", "[red]x"]


def commands(name: str) -> dict[str, list[str]]:
    return {
        "mix": ["mix", name],
        "tokenize": ["tokenize", "--tokenizer", "org/never-loaded", "-i", name],
        "vocab-select": ["vocab-select", "-i", name, "-o", "v.safetensors"],
        "train": ["train", "--target", "org/never-loaded", "--data", name, "--vocab", name,
                  "--out", "run"],
        "eval": ["eval", "--target", "org/never-loaded", "--draft", "d", "--data", name],
        "convert": ["convert", name, "--to", "sglang", "-o", "out"],
        "push": ["push", name, "--repo-id", "org/x", "--dry-run"],
    }


@pytest.mark.parametrize("name", ODD)
def test_odd_names_through_every_error_path(name, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for command, args in commands(name).items():
        r = runner.invoke(app, args, env={"COLUMNS": "80"})
        lines = r.output.strip().splitlines()
        assert r.exit_code == 2, (command, r.output)
        assert len(lines) == 1 and lines[0].startswith(f"error: {name}: "), (command, r.output)
        assert list(tmp_path.iterdir()) == [], command


def test_odd_names_in_file_contents_and_line_numbers(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    name = "[bold]:-1:.jsonl"
    (tmp_path / name).write_text('{"id": "[/x]", "conversations": 7}\n')
    r = runner.invoke(app, ["mix", name])
    assert r.exit_code == 2 and r.output.startswith(f"error: {name}:1: "), r.output


# ---- the corpus of bad outputs (issue 24): refused before any work, naming the path given --

def _unwritable() -> str:
    """A directory nobody can create files in, root included (sysfs), else skip."""
    import tempfile

    try:
        tempfile.NamedTemporaryFile(dir="/sys").close()
    except OSError:
        return "/sys"
    pytest.skip("/sys is writable here")


def bad_outputs(tmp_path) -> list[tuple[list[str], str]]:
    """(arguments, the error line after `error: `) of every output path users get wrong."""
    (tmp_path / "e.txt").write_text("a file")
    (tmp_path / "existing_dir").mkdir()
    (tmp_path / "in.jsonl").write_text("{}\n")
    sysdir = _unwritable()
    file_writers = {  # command -> its arguments before the output path
        "mix": ["mix", "in.jsonl", "-o"],
        "tokenize": ["tokenize", "--tokenizer", "org/never-loaded", "-i", "in.jsonl", "-o"],
        "vocab-select": ["vocab-select", "-i", "in.jsonl", "-o"],
        "regenerate": ["regenerate", "--target", "org/never-loaded", "-i", "in.jsonl", "-o"],
        "eval --samples": ["eval", "--target", "org/never-loaded", "--draft", "d",
                           "--prompts", "mt-bench", "--samples"],
        "eval --plot": ["eval", "--target", "org/never-loaded", "--draft", "d",
                        "--prompts", "mt-bench", "--plot"],
    }
    cases = []
    for command, args in file_writers.items():
        option = args[-1]
        dot = f".: is an existing directory; {option} needs a new name to write"
        cases += [
            (args + ["."], dot),  # a Path option reads "" as "."
            (args + [""], dot if command.startswith("eval") else
             f"{option} '': an empty path; give a file name"),
            (args + ["existing_dir"], f"existing_dir: is a directory; {option} needs a file name"),
            (args + ["e.txt/x.out"], f"e.txt/x.out: e.txt is a file, not a directory ({option})"),
            (args + [f"{sysdir}/x.out"],
             f"{sysdir}/x.out: cannot write in {sysdir} (Permission denied; {option})"),
        ]
    convert = ["convert", "d", "--to", "sglang", "--force", "-o"]
    train = ["train", "--target", "org/never-loaded", "--data", "in.jsonl", "--vocab",
             "in.jsonl", "--out"]
    cases += [
        (convert + ["."], ".: is an existing directory; -o needs a new name to write"),
        (convert + ["e.txt/x"], "e.txt/x: e.txt is a file, not a directory (-o)"),
        (train + ["e.txt/run"], "e.txt/run: e.txt is a file, not a directory (--out)"),
        (train + [f"{sysdir}/run"],
         f"{sysdir}/run: cannot write in {sysdir} (Permission denied; --out)"),
    ]
    return cases


def test_bad_outputs_are_refused_before_any_work(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for args, message in bad_outputs(tmp_path):
        before = sorted(p.name for p in tmp_path.rglob("*"))
        r = runner.invoke(app, args)
        assert r.exit_code == 2, (args, r.output)
        assert r.output == f"error: {message}\n", (args, r.output)
        assert sorted(p.name for p in tmp_path.rglob("*")) == before, args


# ---- an output that is one of the inputs (issue 39, item 2) ----------------------------------

def test_an_output_that_is_an_input_is_refused_and_the_input_kept(tmp_path, monkeypatch):
    """Writing over a file the command reads would replace it (five conversations became
    four token records): refused before any work, by the name given or another name of the
    same file (a path through `.`, a hard link), with the input left byte for byte."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "in.jsonl").write_text('{"id": "a", "messages": []}\n')
    (tmp_path / "sub").mkdir()
    os.link(tmp_path / "in.jsonl", tmp_path / "sub" / "link.jsonl")
    before = (tmp_path / "in.jsonl").read_bytes()
    cases = [
        (["mix", "in.jsonl", "-o", "in.jsonl"], "in.jsonl", "SOURCE in.jsonl", "-o"),
        (["mix", "in.jsonl:0.5", "sub/../in.jsonl:0.5", "-o", "./in.jsonl"], "./in.jsonl",
         "SOURCE in.jsonl", "-o"),
        (["tokenize", "--tokenizer", NEVER, "-i", "in.jsonl", "-o", "sub/link.jsonl"],
         "sub/link.jsonl", "-i in.jsonl", "-o"),
        (["vocab-select", "-i", "in.jsonl", "-o", "in.jsonl"], "in.jsonl", "-i in.jsonl", "-o"),
        (["regenerate", "--target", NEVER, "-i", "in.jsonl", "-o", "in.jsonl", "--force"],
         "in.jsonl", "-i in.jsonl", "-o"),
        (["regenerate", "--target", NEVER, "-i", "in.jsonl", "-o", "in.jsonl"],
         "in.jsonl", "-i in.jsonl", "-o"),
        (["eval", "--target", NEVER, "--draft", "d", "--prompts", "in.jsonl", "--samples",
          "in.jsonl"], "in.jsonl", "--prompts in.jsonl", "--samples"),
        (["eval", "--target", NEVER, "--draft", "d", "--data", "in.jsonl", "--plot",
          "in.jsonl"], "in.jsonl", "--data in.jsonl", "--plot"),
    ]
    for args, out, source, option in cases:
        r = runner.invoke(app, args)
        assert r.exit_code == 2, (args, r.output)
        assert r.output == (f"error: {out}: is also the input ({source}); {option} would "
                            "replace it: write to another file\n"), (args, r.output)
        assert (tmp_path / "in.jsonl").read_bytes() == before, args
        assert sorted(p.name for p in tmp_path.rglob("*")) == ["in.jsonl", "link.jsonl",
                                                                "sub"], args


# ---- memory that is not there: one line, exit 4 (issue 39, items 4 and 5) -------------------

def test_out_of_memory_anywhere_is_one_line_and_exit_4(tmp_path, monkeypatch):
    """XLA's allocator refusing at start-up (a second process on a GPU whose memory the first
    preallocated) and numpy failing to allocate a host array end as one line and exit 4,
    wherever no job named the options to lower; any other runtime error keeps its
    traceback (a bug)."""
    import jax

    from eagle3kit.data import mixing
    from eagle3kit.jobs import common

    monkeypatch.chdir(tmp_path)
    (tmp_path / "in.jsonl").write_text("{}\n")
    train = ["train", "--target", NEVER, "--data", "in.jsonl", "--vocab", "in.jsonl",
             "--out", "run"]

    def no_device_memory(*args):
        raise jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to "
                                         "allocate 60.10GiB")

    monkeypatch.setattr(common, "init_distributed", no_device_memory)
    r = runner.invoke(app, train)
    assert r.exit_code == 4, r.output
    assert r.output.startswith("error: out of device memory (another process may hold it: ")
    assert "XLA_PYTHON_CLIENT_MEM_FRACTION" in r.output and len(r.output.splitlines()) == 1

    def bug(*args):
        raise RuntimeError("an index out of range")

    monkeypatch.setattr(common, "init_distributed", bug)
    r = runner.invoke(app, train)
    assert r.exit_code == 1 and isinstance(r.exception, RuntimeError)

    def no_host_memory(*args, **kwargs):
        raise MemoryError("Unable to allocate 47.7 GiB for an array")

    monkeypatch.setattr(mixing, "mix", no_host_memory)
    r = runner.invoke(app, ["mix", "in.jsonl", "-o", "out.jsonl"])
    assert r.exit_code == 4, r.output
    assert r.output == "error: out of host memory; lower the batch or cache sizes (see --help)\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.jsonl"]


# ---- SIGTERM is SIGINT: clean up, one line, exit 143 (issue 24, item 4) ---------------------

def _terminate_once_writing(args: list[str], cwd: Path, out: str) -> subprocess.CompletedProcess:
    """Runs `eagle3kit ARGS` in `cwd`, sends SIGTERM once its temporary output has data."""
    p = subprocess.Popen([sys.executable, "-m", "eagle3kit", *args], cwd=cwd,
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and p.poll() is None:
        if any(t.stat().st_size > 0 for t in cwd.glob(f".{out}.*.tmp")):
            break
        time.sleep(0.05)
    assert p.poll() is None, "finished before it could be stopped; give it more input"
    p.send_signal(signal.SIGTERM)
    _, err = p.communicate(timeout=60)
    return subprocess.CompletedProcess(p.args, p.returncode, "", err)


@pytest.mark.parametrize("command", ["mix", "tokenize -j 1", "tokenize -j 2"])
def test_sigterm_cleans_up_like_sigint(command, tmp_path):
    chats = tmp_path / "chats.jsonl"
    if command == "mix":  # the real ShareGPT file, all of it: seconds of writing
        args = ["mix", str(assets.sharegpt_path()), "-o", "out.jsonl"]
    else:
        with open(chats, "w") as f:
            for i in range(40_000):
                f.write(json.dumps({"id": str(i), "messages": [
                    {"role": "user", "content": f"question {i}"},
                    {"role": "assistant", "content": f"answer {i} " * 20}]}) + "\n")
        args = ["tokenize", "--tokenizer", str(assets.smollm2_gguf()), "-i", str(chats),
                "-o", "out.jsonl", *command.split()[1:]]
    p = _terminate_once_writing(args, tmp_path, "out.jsonl")
    assert p.returncode == 143, p.stderr
    assert p.stderr.splitlines()[-1] == "terminated", p.stderr
    assert "Traceback" not in p.stderr and "Error" not in p.stderr, p.stderr
    assert sorted(x.name for x in tmp_path.iterdir()) == sorted(
        ["chats.jsonl"] if chats.exists() else [])


# ---- the corpus of bad options (issue 24): one error line, the class's exit code -----------

NEVER = "org/never-loaded"  # refused before any model is read
BAD_OPTIONS = [
    (["train", "--target", NEVER, "--data", "d", "--vocab", "v", "--out", "run",
      "--max-steps", "0"], 2, "--max-steps 0: must be at least 1"),
    (["train", "--target", NEVER, "--data", "d", "--vocab", "v", "--out", "run",
      "--max-steps", "-3"], 2, "--max-steps -3: must be at least 1"),
]


@pytest.mark.parametrize("args, code, message", BAD_OPTIONS)
def test_bad_options_are_one_line(args, code, message, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    r = runner.invoke(app, args)
    assert r.exit_code == code, r.output
    assert r.output == f"error: {message}\n", r.output
    assert list(tmp_path.iterdir()) == []


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """The tiny target with SmolLM2's tokenizer (256 positions), its data and vocab, and a
    random draft for it trained, it says, with --ttt-length 3."""
    a = assets.train_assets()
    draft = assets.random_draft(tmp_path_factory.mktemp("errors") / "draft", {"ttt_length": 3})
    return a, draft


def test_limits_of_the_target_and_the_draft_are_one_line(tiny, tmp_path, monkeypatch):
    """Refused against what the target and draft are, not a traceback or an out-of-memory:
    --seq-len beyond the target's positions (train leaves no run behind), a tree shape that
    the draft's own K (3, not the default 7) cannot make."""
    a, draft = tiny
    monkeypatch.chdir(tmp_path)
    target = ["--target", str(a / "target")]
    cases = [
        (["train", *target, "--data", str(a / "train.jsonl"), "--vocab",
          str(a / "vocab.safetensors"), "--out", "run", "--seq-len", "100000"],
         f"--seq-len 100000 exceeds the target's 256 positions ({a / 'target'})"),
        (["eval", *target, "--draft", str(draft), "--data", str(a / "heldout.jsonl"),
          "--seq-len", "100000"],
         f"--seq-len 100000 exceeds the target's 256 positions ({a / 'target'})"),
        (["eval", *target, "--draft", str(draft), "--prompts", "mt-bench", "--topk", "4",
          "--draft-tokens", "100"], "--steps 3 (the draft's --ttt-length) --topk 4 "
         "--draft-tokens 100: draft tokens 100 outside 2..37: 3 steps of top-4 propose 36 "
         "candidates"),
        (["eval", *target, "--draft", str(draft), "--prompts", "mt-bench", "--draft-tokens",
          "10"], "--steps 3 (the draft's --ttt-length) --topk 1 --draft-tokens 10: a chain "
         "(topk 1) verifies steps + 1 = 4 draft tokens, not 10"),
    ]
    for args, message in cases:
        r = runner.invoke(app, args)
        assert (r.exit_code, r.output) == (2, f"error: {message}\n"), args
        assert list(tmp_path.iterdir()) == [], args


def _limited(args: list[str], cwd: Path, gib: int = 8) -> subprocess.CompletedProcess:
    """`eagle3kit ARGS` with its address space capped: an allocation past it fails at once,
    as a device's does, instead of paging this machine to death."""
    start = (f"import resource, runpy, sys; resource.setrlimit(resource.RLIMIT_AS, "
             f"({gib << 30}, {gib << 30})); sys.argv = ['eagle3kit'] + sys.argv[1:]; "
             "runpy.run_module('eagle3kit', run_name='__main__')")
    return subprocess.run([sys.executable, "-c", start, *args], cwd=cwd, text=True,
                          capture_output=True, timeout=300)


def test_out_of_memory_in_generation_is_exit_4_with_the_flags_to_lower(tiny, tmp_path):
    """As train's: a KV cache or a decode program that does not fit is a ResourceError
    naming the options, not a RESOURCE_EXHAUSTED traceback (issue 24, item 2)."""
    a, draft = tiny
    # the cache is sized to the work (rows: the answers to write, rounded up to a power of two): 4,000
    # conversations of 100 samples each ask for more rows than the capped memory holds
    chats = tmp_path / "chats.jsonl"
    chats.write_text("".join(json.dumps({"id": f"c{i}", "messages": [
        {"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}) + "\n"
        for i in range(4000)))
    p = _limited(["regenerate", "--target", str(a / "target"), "-i", str(chats), "-o",
                  "out.jsonl", "--slots", "1000000", "--max-context", "256",
                  "--max-new-tokens", "8", "--samples", "100", "--temperature", "0.9"], tmp_path)
    assert p.returncode == 4, p.stderr
    # the sizes between the flags and the advice are this machine's (what is free)
    last = p.stderr.splitlines()[-1]
    assert last.startswith("error: out of device memory for --slots 1000000 x --max-context "
                           "256 (524288 x 256 for this input): the KV cache "), p.stderr
    assert last.endswith("; lower --slots or --max-context (or add devices: --mesh)"), p.stderr
    assert sorted(x.name for x in tmp_path.iterdir()) == ["chats.jsonl"]


def test_out_of_memory_in_eval_generation_is_exit_4(tiny, tmp_path):
    """A --concurrency size that cannot fit is refused before the batch-1 answers (on a
    large target those take minutes; they compiled and ran a minute here), not after."""
    a, draft = tiny
    chats = tmp_path / "chats.jsonl"
    chats.write_text(json.dumps({"id": "a", "messages": [{"role": "user", "content": "hi"}]})
                     + "\n")
    p = _limited(["eval", "--target", str(a / "target"), "--draft", str(draft), "--prompts",
                  str(chats), "--max-new-tokens", "4", "--concurrency", "1000000", "--json"],
                 tmp_path)
    assert p.returncode == 4 and p.stdout == "", p.stderr
    assert "generate turns" not in p.stderr, p.stderr  # no turn was answered first
    # refused before allocating (a CPU counts host memory): the sizes in the middle are this
    # machine's (what is free)
    last = p.stderr.splitlines()[-1]
    assert last.startswith("error: out of device memory for --max-new-tokens 4 at "
                           "--concurrency 1000000: the KV cache "), p.stderr
    assert last.endswith("; lower --max-new-tokens, the --concurrency batch sizes or --limit "
                         "(long prompts), or add devices: --mesh tensor=N"), p.stderr


def test_errors_name_the_file_and_the_place(tiny, tmp_path, monkeypatch):
    """A --chat-template that Jinja cannot parse is named; a cut JSONL line says where it
    stops (issue 24, item 8)."""
    a, _ = tiny
    monkeypatch.chdir(tmp_path)
    Path("broken.jinja").write_text("{% for m in messages %}{{ m.content }")
    chat = {"id": "a", "messages": [{"role": "user", "content": "hi"},
                                    {"role": "assistant", "content": "hello"}]}
    Path("chats.jsonl").write_text(json.dumps(chat) + "\n")
    Path("cut.jsonl").write_text(json.dumps(chat)[:40] + "\n")
    cases = [
        (["tokenize", "--tokenizer", str(a / "target"), "-i", "chats.jsonl",
          "--chat-template", "broken.jinja", "-o", "t.jsonl"],
         "broken.jinja: the chat template refuses it: unexpected '}'"),
        (["regenerate", "--target", str(a / "target"), "-i", "chats.jsonl", "--chat-template",
          "broken.jinja", "-o", "r.jsonl"],
         "broken.jinja: the chat template refuses it: unexpected '}'"),
        (["mix", "cut.jsonl", "-o", "m.jsonl"], "cut.jsonl:1: malformed JSON: Expecting ',' "
         "delimiter: column 41 (pass --skip-invalid to skip such records)"),  # the cut
    ]
    for args, message in cases:
        r = runner.invoke(app, args)
        assert (r.exit_code, r.output.splitlines()[-1]) == (2, f"error: {message}"), args
    assert sorted(p.name for p in tmp_path.iterdir()) == ["broken.jinja", "chats.jsonl",
                                                          "cut.jsonl"]


# ---- the corpus of usage errors (issue 24, item 11): our one `error:` line, not Typer's box --

N = ["--target", NEVER]
BAD_USAGE = [  # (arguments, the line after `error: `), every command; nothing is loaded
    (["trian"], "no such command 'trian'; did you mean 'train'? (see eagle3kit --help)"),
    (["--bogus"], "no such option: --bogus (see eagle3kit --help)"),
    (["mix"], "missing argument SOURCE[:WEIGHT]... (see eagle3kit mix --help)"),
    (["mix", "a", "--format", "zz"], "--format 'zz'; choose one of auto, sharegpt, "
     "perfectblend, openai, ultrachat (see eagle3kit mix --help)"),
    (["mix", "a", "-n", "x"], "-n 'x': not an integer (see eagle3kit mix --help)"),
    (["tokenize"], "missing option --tokenizer (see eagle3kit tokenize --help)"),
    (["tokenize", "-t", NEVER, "--max-length", "-5"],
     "--max-length '-5': must be at least 1 (see eagle3kit tokenize --help)"),
    (["tokenize", "-t"], "option '-t' requires an argument (see eagle3kit tokenize --help)"),
    (["vocab-select", "-o", "v", "--size", "1.5"],
     "--size '1.5': not an integer (see eagle3kit vocab-select --help)"),
    (["vocab-select", "-o", "v", "--bogus"],
     "no such option: --bogus; did you mean --out? (see eagle3kit vocab-select --help)"),
    (["regenerate", "-i", "x"], "missing option --target (see eagle3kit regenerate --help)"),
    (["regenerate", *N, "--slots", "many"],
     "--slots 'many': not an integer (see eagle3kit regenerate --help)"),
    (["regenerate", *N, "--target-dtype", "fp8"],
     "--target-dtype 'fp8': choose bfloat16, float32 (see eagle3kit regenerate --help)"),
    (["train", *N, "--data", "d", "--vocab", "v"],
     "missing option --out (see eagle3kit train --help)"),
    (["train", *N, "--data", "d", "--vocab", "v", "--out", "o", "--decay", "abc"],
     "--decay 'abc': not a number (see eagle3kit train --help)"),
    (["train", *N, "--data", "d", "--vocab", "v", "--out", "o", "extra"],
     "got unexpected extra argument(s) (extra) (see eagle3kit train --help)"),
    (["eval", *N, "--draft", "d", "--dtype", "foo"],
     "--dtype 'foo': choose bfloat16, float32 (see eagle3kit eval --help)"),
    (["eval", *N, "--draft", "d", "--limit", "0"],
     "--limit '0': must be at least 1 (see eagle3kit eval --help)"),
    (["eval", *N, "--draft", "d", "--prompts", "p", "--json", "--samples", "-"],
     "--samples: stdout carries the --json result; write samples to a file "
     "(see eagle3kit eval --help)"),
    (["convert", "--to", "sglang"], "missing argument SOURCE (see eagle3kit convert --help)"),
    (["convert", "d", "--to", "gguf", "-o", "x"], "--to 'gguf'; choose one of sglang, "
     "speculators, eagle3kit (see eagle3kit convert --help)"),
    (["push", "d"], "missing option --repo-id (see eagle3kit push --help)"),
    (["push", "d", "--repo-id", "o/x", "--privat"],
     "no such option: --privat; did you mean --private? (see eagle3kit push --help)"),
]


@pytest.mark.parametrize("args, message", BAD_USAGE, ids=[" ".join(a) for a, _ in BAD_USAGE])
def test_usage_errors_are_our_one_line(args, message, tmp_path, monkeypatch):
    """Typer's boxed usage panel beside our `error:` lines was two styles for one kind of
    mistake: every usage error is one line in ours, with the command's --help, exit 2."""
    monkeypatch.chdir(tmp_path)
    r = runner.invoke(app, args)
    assert (r.exit_code, r.output) == (2, f"error: {message}\n"), r.output
    assert list(tmp_path.iterdir()) == []


def test_thinking_needs_a_template_with_a_thinking_switch(tiny, tmp_path, monkeypatch):
    """--thinking/--no-thinking on a template that ignores enable_thinking (SmolLM2's, Gemma's)
    was silently accepted: each command that takes it refuses it in one line naming the
    template and the option, before any model is loaded or anything written; Qwen3's
    template, which has the switch, takes it (issue 24, item 11)."""
    a, draft = tiny
    monkeypatch.chdir(tmp_path)
    Path("chats.jsonl").write_text(json.dumps({"id": "a", "messages": [
        {"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}) + "\n")
    target = str(a / "target")
    smollm2 = f"the chat template of {target} has no thinking switch (it ignores enable_thinking)"
    cases = [
        (["tokenize", "--tokenizer", target, "-i", "chats.jsonl", "-o", "t.jsonl", "--thinking"],
         f"--thinking: {smollm2}; leave --thinking out"),
        (["eval", "--target", target, "--draft", str(draft), "--prompts", "mt-bench",
          "--no-thinking"], f"--no-thinking: {smollm2}; leave --no-thinking out"),
        (["regenerate", "--target", target, "-i", "chats.jsonl", "-o", "r.jsonl", "--thinking"],
         f"--thinking: {smollm2}; leave --thinking out"),
        (["tokenize", "--tokenizer", target, "-i", "chats.jsonl", "-o", "t.jsonl",
          "--chat-template", "gemma", "--no-thinking"], "--no-thinking: --chat-template gemma "
         "has no thinking switch (it ignores enable_thinking); leave --no-thinking out"),
    ]
    for args, message in cases:
        r = runner.invoke(app, args)
        assert (r.exit_code, r.output) == (2, f"error: {message}\n"), args
    assert sorted(p.name for p in tmp_path.iterdir()) == ["chats.jsonl"]
    qwen3 = Path(__file__).parents[1] / "data" / "templates" / "qwen3-8b.jinja"
    r = runner.invoke(app, ["tokenize", "--tokenizer", target, "-i", "chats.jsonl", "-o",
                            "t.jsonl", "--chat-template", str(qwen3), "--no-thinking", "-j", "1"])
    assert r.exit_code == 0 and Path("t.jsonl").stat().st_size > 0, r.output
