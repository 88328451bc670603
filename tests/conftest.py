"""Test set-up: 8 simulated CPU devices so sharded code runs without a GPU."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# One compilation cache per test session, shared with the subprocesses the CLI tests start:
# the many tiny train/eval/regenerate runs compile the same programs again and again (every
# run builds its own jitted step), and a cache hit skips XLA's compile (a repeated tiny
# `train` run: 9 s -> 3 s). Every program is cached, however fast it compiled; a fresh
# directory each session, so CI never reads a stale one.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    _cache = tempfile.mkdtemp(prefix="eagle3kit-test-xla-cache-")
    atexit.register(shutil.rmtree, _cache, ignore_errors=True)
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _cache
    os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "-1"

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_default_matmul_precision", "highest")

import pytest  # noqa: E402

from tests import assets  # noqa: E402


@pytest.fixture(scope="session")
def smollm2_gguf():
    return assets.smollm2_gguf()


@pytest.fixture(scope="session")
def sharegpt_path():
    return assets.sharegpt_path()


@pytest.fixture(scope="session")
def smollm2_trained_draft(tmp_path_factory):
    """A small EAGLE3 draft trained for the real SmolLM2 on its own greedy answers to
    MT-bench questions (tests/smollm2_draft.py): `.path`, `.draft`, `.prompts`, `.answers`.
    Built once per test session: the first process of `pytest -n` that needs it trains it
    (about a minute) under a lock, the others read it."""
    from filelock import FileLock

    from tests import smollm2_draft

    shared = tmp_path_factory.getbasetemp()  # xdist: the worker's, below the session's
    if os.environ.get("PYTEST_XDIST_WORKER"):
        shared = shared.parent
    with FileLock(shared / "smollm2-draft.lock"):
        return smollm2_draft.trained_draft(shared / "smollm2-draft")


# The longest modules first. `make test` runs `pytest -n 2 --dist loadfile`, which hands whole
# modules to the two workers in collection order: a long module collected late ran alone at
# the end while the other worker idled (minutes of a 17-minute run). Longest first is the
# classic fix; the order is by measured module time (`pytest --durations`), the rest as
# collected.
LONGEST_FIRST = ("cli/test_train.py", "cli/test_eval.py", "cli/test_regenerate.py",
                 "core/test_gemma3_real.py", "cli/test_gemma3_pipeline.py",
                 "decode/test_engine.py", "examples/test_recipes.py", "cli/test_train_kill.py",
                 "data/test_tokenizer.py", "core/test_target.py")


def pytest_collection_modifyitems(session, config, items):
    rank = {f"tests/{m}": i for i, m in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(rank)))
