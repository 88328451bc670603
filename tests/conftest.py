"""Test set-up: 8 simulated CPU devices so sharded code runs without a GPU."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
import types
from pathlib import Path

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

# GGUF tokenizers kept between processes (data/tokenizer_cache.py) in the session's own
# directory, as the compile cache: never the user's ~/.cache, never another checkout's entry.
if "EAGLE3KIT_TOKENIZER_CACHE" not in os.environ:
    os.environ["EAGLE3KIT_TOKENIZER_CACHE"] = tempfile.mkdtemp(prefix="eagle3kit-test-tok-")
    atexit.register(shutil.rmtree, os.environ["EAGLE3KIT_TOKENIZER_CACHE"], ignore_errors=True)

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_default_matmul_precision", "highest")

import pytest  # noqa: E402

from tests import assets, warm_cli  # noqa: E402


@pytest.fixture(scope="session")
def smollm2_gguf():
    return assets.smollm2_gguf()


@pytest.fixture(scope="session")
def sharegpt_path():
    return assets.sharegpt_path()


def _session_dir(tmp_path_factory) -> Path:
    """A directory every process of the session sees (xdist: the workers' common parent)."""
    shared = tmp_path_factory.getbasetemp()
    return shared.parent if os.environ.get("PYTEST_XDIST_WORKER") else shared


@pytest.fixture(scope="session")
def smollm2_trained_draft(tmp_path_factory):
    """A small EAGLE3 draft trained for the real SmolLM2 on its own greedy answers to
    MT-bench questions (tests/smollm2_draft.py): `.path`, `.draft`, `.prompts`, `.answers`.
    Built once per test session: the first process of `pytest -n` that needs it trains it
    (about a minute) under a lock, the others read it."""
    from filelock import FileLock

    from tests import smollm2_draft

    shared = _session_dir(tmp_path_factory)
    with FileLock(shared / "smollm2-draft.lock"):
        return smollm2_draft.trained_draft(shared / "smollm2-draft")


@pytest.fixture(scope="session")
def smollm2_torch(tmp_path_factory):
    """SmolLM2-135M-Instruct as transformers loads its GGUF (assets.smollm2_torch), converted
    once per test session: the first process of `pytest -n` that needs it saves the weights
    it converted (10-15 s), the others load them (a second)."""
    from filelock import FileLock

    shared = _session_dir(tmp_path_factory)
    with FileLock(shared / "smollm2-torch.lock"):
        return assets.smollm2_torch(shared / "smollm2-torch")


@pytest.fixture(scope="session")
def eagle3kit_server():
    """`eagle3kit` as a fork server for this test process (tests/warm_cli.py): `.sock`, and
    `.env`, the commands' environment (this process's, the tree's src and tests importable).
    Each command is a process of its own without a fresh interpreter's seconds of imports."""
    root = Path(__file__).resolve().parents[1]
    paths = [str(root / "src"), str(root), os.environ.get("PYTHONPATH", "")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in paths if p)}
    with warm_cli.serving(env) as sock:
        yield types.SimpleNamespace(sock=sock, env=env)


# The longest modules first. `make test` runs `pytest -n 2 --dist loadfile`, which hands whole
# modules to the two workers in queue order: a long module queued late runs alone at the end
# while the other worker idles. Longest first is the classic fix. xdist (3.x) reorders the
# queue by the number of tests in each module unless told not to (`--loadscope-reorder` is on
# by default), which put one-test modules such as the Gemma pipeline (minutes) last: it is
# turned off below, so the queue is this order. The order is by measured module time (each
# test's time summed per file, from a whole `pytest -n 2 --dist loadfile` run), modules
# under 10 s as collected, after these.
LONGEST_FIRST = ("cli/test_regenerate.py", "core/test_gemma3_real.py", "decode/test_engine.py",
                 "formats/test_sglang_library.py", "examples/test_qwen_coder_recipe.py",
                 "cli/test_eval.py", "cli/test_train.py", "cli/test_eval_smollm2.py",
                 "cli/test_gemma3_pipeline.py", "examples/test_recipes.py",
                 "core/test_target.py", "cli/test_train_smollm2.py", "core/test_families.py",
                 "cli/test_train_kill.py", "decode/test_engine_speculative.py",
                 "cli/test_train_equivalences.py", "data/test_tokenizer.py",
                 "cli/test_families_pipeline.py", "core/test_multihost.py",
                 "decode/test_smollm2.py", "cli/test_errors.py", "decode/test_ragged_attention.py",
                 "decode/test_speculative.py", "core/test_ttt.py", "decode/test_tree.py",
                 "cli/test_eval_sweep.py", "cli/test_eval_tracking.py", "decode/test_sampling.py",
                 "jobs/test_evaluate.py", "decode/test_draft_cache.py", "cli/test_tokenize.py",
                 "cli/test_train_signals.py", "core/test_draft.py", "core/test_losses.py",
                 "formats/test_real_smollm2.py", "decode/test_engine_profile.py",
                 "core/test_flash.py", "formats/test_sglang.py", "data/test_tokenizing.py")


def pytest_configure(config):
    if hasattr(config.option, "loadscopereorder"):  # pytest-xdist is loaded
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(session, config, items):
    rank = {f"tests/{m}": i for i, m in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(rank)))
