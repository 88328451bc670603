"""The persistent compile cache of `regenerate`, `eval` and `train` (jobs/common.compile_cache):
programs go to disk and come back; a directory that cannot be written, or entries that are
corrupt, give a warning and a run that compiles without them, with the same result.

Each case is a fresh process (on a CPU, the cache set up as on an accelerator): a process
reads its cache directory once, and this test session has its own (tests/conftest.py).
"""

from __future__ import annotations

import os
import subprocess
import sys
import types
from pathlib import Path

import jax

from eagle3kit.jobs import common
from eagle3kit.jobs.common import compile_cache

PROGRAM = """
import sys
import jax, jax.numpy as jnp
from eagle3kit.jobs.common import use_compile_cache
print("cache:", use_compile_cache(sys.argv[1], print))
print("result:", float(jax.jit(lambda x: (x * 2 + 1).sum())(jnp.arange(10.0))))
"""


def run(path: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "JAX_COMPILATION_CACHE_DIR"}
    env.update(JAX_PLATFORMS="cpu", JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
               JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="-1",
               PYTHONPATH=os.pathsep.join(sys.path))
    return subprocess.run([sys.executable, "-c", PROGRAM, str(path)], env=env,
                          capture_output=True, text=True, timeout=120)


def test_programs_are_kept_and_a_corrupt_entry_is_compiled_again(tmp_path):
    cache = tmp_path / "made" / "xla"
    first = run(cache)
    assert first.returncode == 0, first.stderr
    assert first.stdout.splitlines() == [f"cache: {cache}", "result: 100.0"]
    entries = [p for p in cache.iterdir() if p.is_file() and not p.name.startswith(".")]
    assert entries
    for p in entries:
        p.write_bytes(b"not a program")
    again = run(cache)
    assert again.returncode == 0, again.stderr
    assert again.stdout.splitlines() == [f"cache: {cache}", "result: 100.0"]
    assert "Error reading persistent compilation cache entry" in again.stderr


def test_a_directory_that_cannot_be_written_warns_and_compiles_without_it(tmp_path):
    (tmp_path / "file").write_text("")
    r = run(tmp_path / "file" / "xla")  # a file in the way: even root cannot make it
    assert r.returncode == 0, r.stderr
    warning, *rest = r.stdout.splitlines()
    assert warning.startswith(f"warning: compile cache {tmp_path / 'file' / 'xla'}: ")
    assert "compiling without it" in warning
    assert rest == ["cache: None", "result: 100.0"]


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
