"""Test set-up: 8 simulated CPU devices so sharded code runs without a GPU."""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

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
def smollm2_trained_draft():
    """A small EAGLE3 draft trained for the real SmolLM2 on its own greedy answers to
    MT-bench questions (tests/smollm2_draft.py): `.path`, `.draft`, `.prompts`, `.answers`."""
    from tests import smollm2_draft

    return smollm2_draft.trained_draft()
