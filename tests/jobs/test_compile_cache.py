"""The persistent compile cache of `regenerate`, `eval` and `train` (jobs/common.compile_cache):
programs go to disk and come back; a directory that cannot be written, or entries that are
corrupt, give a warning and a run that compiles without them, with the same result.

Each case is `eagle3kit regenerate` or `eval` as a process of its own (on a CPU, the cache
asked for by EAGLE3KIT_COMPILE_CACHE): a process reads its cache directory once, and this
test session has its own (tests/conftest.py).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import types
from pathlib import Path

import jax
import pytest

from eagle3kit.jobs import common
from eagle3kit.jobs.common import compile_cache
from tests import warm_cli


def test_jaxs_own_setting_wins_a_cpu_sets_none_and_an_accelerator_reads_the_variable(
        monkeypatch, tmp_path):
    said = []
    assert compile_cache(said.append) == jax.config.jax_compilation_cache_dir  # conftest's

    def backend(name: str) -> None:
        monkeypatch.setattr(common, "jax", types.SimpleNamespace(
            config=types.SimpleNamespace(jax_compilation_cache_dir=None),
            default_backend=lambda: name))

    backend("cpu")
    assert compile_cache(said.append) is None and not said
    backend("gpu")
    (tmp_path / "file").write_text("")
    monkeypatch.setenv("EAGLE3KIT_COMPILE_CACHE", str(tmp_path / "file" / "xla"))
    assert compile_cache(said.append) is None
    assert len(said) == 1 and "compiling without it" in said[0]


def chats_file(directory: Path) -> Path:
    """Two real ShareGPT conversations."""
    from eagle3kit.data.records import encode
    from tests import assets

    chats = directory / "chats.jsonl"
    if not chats.exists():
        chats.write_bytes(b"".join(encode(c) for c in assets.sharegpt_chats(2)))
    return chats


def regenerate_args(chats: Path, kv_attention: str) -> list[str]:
    """`regenerate` of every turn of `chats`, two samples each (sampled, fp32) by the tiny
    random target, to stdout: run by `cli`, the programs of prefills of first
    and later pieces, the row copy and the steps."""
    from tests import assets

    return ["regenerate", "--target", str(assets.train_assets() / "target"), "-i", str(chats),
            "-o", "-", "--samples", "2", "--temperature", "0.9", "--max-new-tokens", "6",
            "--max-context", "256", "--slots", "4", "--target-dtype", "float32", "--mesh",
            "data=1,tensor=1", "--kv-attention", kv_attention]


@pytest.fixture(scope="module")
def window_runs(tmp_path_factory, cli):
    """(cache directory, [a run that filled it, a run that read it]): `regenerate` on the
    window path as two processes (`cli`) with one compile cache. Both tests below read these
    runs (each pair of runs compiles and loads the same programs)."""
    directory = tmp_path_factory.mktemp("window")
    cache = directory / "xla"
    args = regenerate_args(chats_file(directory), "xla")
    return cache, [cli(cache, *args) for _ in range(2)]


@pytest.fixture(scope="module")
def cli():
    """`cli(cache, *ARGS)`: `eagle3kit ARGS` on the CPU with EAGLE3KIT_COMPILE_CACHE=cache,
    every program cached however fast it compiled; JAX's own variable, which this session
    sets (tests/conftest.py), left out. Each command is a process of its own, forked from a
    server that imported eagle3kit and JAX but started no backend and read no cache
    (tests/warm_cli.py): it reads its cache directory once, as a fresh process does, without
    a fresh interpreter's seconds of imports."""
    env = {k: v for k, v in os.environ.items() if k != "JAX_COMPILATION_CACHE_DIR"}
    env.update(JAX_PLATFORMS="cpu", JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
               JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="-1",
               PYTHONPATH=os.pathsep.join(sys.path), COLUMNS="250")
    with warm_cli.serving(env) as sock:
        def run(cache: Path, *args: str) -> subprocess.CompletedProcess:
            command = warm_cli.Command(sock, list(args), env={
                **env, "EAGLE3KIT_COMPILE_CACHE": str(cache)}, stdout=warm_cli.PIPE,
                stderr=warm_cli.PIPE, text=True)
            out, err = command.communicate(timeout=600)
            return subprocess.CompletedProcess(args, command.returncode, out, err)

        yield run


def test_a_corrupt_or_unwritable_cache_warns_once_and_answers_the_same(window_runs, cli,
                                                                       tmp_path):
    """Issue 36's bad input through the CLI: entries overwritten with garbage or cut short,
    and a cache path under a regular file (which even root cannot make), each give one
    warning line and exactly the answers a run with a sound cache gives (one that read its
    programs from it); no traceback, no Python warning."""
    filled, (first, sound) = window_runs
    assert first.returncode == 0, first.stderr
    assert "compile cache" not in first.stderr, first.stderr
    cache = tmp_path / "xla"  # a copy: the fixture's runs stay as they were
    shutil.copytree(filled, cache)
    entries = sorted(p for p in cache.iterdir() if p.name.endswith("-cache"))
    assert entries, sorted(p.name for p in cache.iterdir())
    kept = sorted((cache / common.EXECUTABLES).glob("*.exe"))  # decode/executables.py
    assert kept
    entries += kept
    assert (sound.returncode, sound.stdout) == (0, first.stdout), sound.stderr
    assert "compile cache" not in sound.stderr, sound.stderr
    for i, p in enumerate(entries):  # garbage, or a real entry cut in half
        p.write_bytes(b"not a program" if i % 2 else p.read_bytes()[: p.stat().st_size // 2])
    (tmp_path / "file").write_text("")
    args = regenerate_args(chats_file(tmp_path), "xla")
    for path, says in ((cache, f"warning: compile cache {cache}: an entry could not be read ("),
                       (tmp_path / "file" / "xla",
                        f"warning: compile cache {tmp_path / 'file' / 'xla'}: Not a directory; "
                        "compiling without it")):
        r = cli(path, *args)
        assert (r.returncode, r.stdout) == (0, first.stdout), r.stderr
        said = [line for line in r.stderr.splitlines() if "compile cache" in line]
        assert len(said) == 1 and said[0].startswith(says), r.stderr
        assert "Traceback" not in r.stderr and "Warning" not in r.stderr, r.stderr


def evaluate(cli, tmp_path: Path, cache: Path) -> subprocess.CompletedProcess:
    """`eagle3kit eval --prompts` of one two-turn conversation by the tiny random target and a
    random draft (fp32, greedy) by `cli` with EAGLE3KIT_COMPILE_CACHE=cache."""
    import json

    from tests import assets

    prompts, draft = tmp_path / "prompts.jsonl", tmp_path / "draft"
    if not prompts.exists():
        prompts.write_text(json.dumps({"turns": ["Name a color.", "And another one?"]}) + "\n")
        assets.random_draft(draft)
    return cli(cache, "eval", "--target", str(assets.train_assets() / "target"), "--draft",
                str(draft), "--prompts", str(prompts), "--steps", "3", "--max-new-tokens", "8",
                "--dtype", "float32", "--target-dtype", "float32", "--json")


ENGINE_PROGRAMS = 6


def test_a_second_eval_loads_every_program_of_its_turns_from_the_cache(cli, tmp_path):
    """Issue 36: `eval --prompts` run again in a fresh process compiles nothing its turns
    run (speculative and plain): every program comes from the first run's cache, its
    compile seconds (what is left: tracing and lowering, and the loads) fall, and the
    answers are the same."""
    import json

    first = evaluate(cli, tmp_path, tmp_path / "xla")
    assert first.returncode == 0, first.stderr
    again = evaluate(cli, tmp_path, tmp_path / "xla")
    assert again.returncode == 0, again.stderr
    one, two = json.loads(first.stdout), json.loads(again.stdout)
    assert one["compiled_programs"] > 0 and one["programs_from_cache"] == 0
    assert two["programs_from_cache"] == two["compiled_programs"] == one["compiled_programs"]
    # the engine's programs whole (decode/executables.py: not even traced): its prefill
    # (first pieces, later pieces: two engines), verify and decode steps, cache allocators
    assert two["programs_from_executables"] >= ENGINE_PROGRAMS, two
    assert one["programs_from_executables"] == 0
    assert two["compile_s"] < one["compile_s"] / 2, (one["compile_s"], two["compile_s"])
    same = ("new_tokens", "identical_to_baseline", "accept_histogram", "tau_pooled")
    assert {k: two[k] for k in same} == {k: one[k] for k in same}
    # every kept executable damaged: one warning line, each program compiled again, the
    # same answers
    for i, p in enumerate(sorted((tmp_path / "xla" / common.EXECUTABLES).glob("*.exe"))):
        p.write_bytes(b"not a program" if i % 2 else p.read_bytes()[: p.stat().st_size // 2])
    damaged = evaluate(cli, tmp_path, tmp_path / "xla")
    assert damaged.returncode == 0, damaged.stderr
    said = [line for line in damaged.stderr.splitlines() if "compile cache" in line]
    assert len(said) == 1 and "an entry could not be read" in said[0], damaged.stderr
    three = json.loads(damaged.stdout)
    assert three["programs_from_executables"] == 0
    assert {k: three[k] for k in same} == {k: one[k] for k in same}


def test_regenerate_compiles_its_programs_ahead_and_a_second_run_loads_them(window_runs, cli,
                                                                           tmp_path):
    """Issue 36 item 3: with a compile cache in use, `regenerate` compiles every program its
    turns and samples can meet before the first turn, several at once (prefill shapes of
    first and later pieces, the row copy, and the kernel's one step): generation then
    compiles nothing (the kernel path, whose interpreted kernel on a CPU is kept in no
    cache); on the window path (whose step compiles per window as rows grow) a second run
    in a fresh process loads every program compiled ahead; all write the same file."""
    import re

    runs = [cli(tmp_path / "pallas", *regenerate_args(chats_file(tmp_path), "pallas")),
            *window_runs[1]]
    ahead = []
    for r in runs:
        assert r.returncode == 0, r.stderr
        m = re.search(r"(\d+) programs compiled ahead in [\d.]+s \((\d+) of them loaded", r.stderr)
        assert m, r.stderr
        ahead.append((int(m[1]), int(m[2])))
    assert "; 0 programs compiled meanwhile" in runs[0].stderr, runs[0].stderr
    # the window path's steps compile as rows grow; a second run loads those and nothing
    # more (a program met with its cache laid out as a step returns it, not as allocated,
    # was loaded again)
    meanwhile = [re.search(r"(\d+) programs? compiled meanwhile", r.stderr)[1] for r in runs[1:]]
    assert meanwhile[0] == meanwhile[1], meanwhile
    assert runs[0].stdout == runs[1].stdout == runs[2].stdout
    assert runs[0].stdout.count("\n") == 4
    # prefill: first and later pieces of 128 and 256 tokens, the row copy (and the step)
    assert ahead == [(6, 0), (5, 0), (5, 5)], ahead
