"""A tiny random target and draft shared by the decode tests (built once), and a tiny target
whose answers depend on the whole context."""

from __future__ import annotations

import pytest

from tests import assets


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    """Where the tiny target's HF checkpoint lives."""
    return tmp_path_factory.mktemp("tiny")


@pytest.fixture(scope="session")
def tiny(tiny_dir):
    """(target config, target weights, draft config, draft weights, VocabArrays, mesh)."""
    return assets.tiny_target_and_draft(tiny_dir, seed=1)


@pytest.fixture(scope="session")
def accepting_draft(tiny):
    """A draft trained on the tiny target's greedy continuations (tests/decode/accepting.py)."""
    from tests.decode import accepting

    tcfg, tw, _, _, _, mesh = tiny
    return accepting.build(tcfg, tw, mesh)


@pytest.fixture(scope="session")
def chaotic(tmp_path_factory):
    """(torch model, fp32 weights on one device): the tiny Llama's config with weights drawn
    15x larger than transformers' default (initializer_range 0.3), so that attention, not the
    newest token alone, decides the next token. At the default scale the tiny model's greedy
    answers settle on one token and ignore most of the context, so a decoder that drops or
    misplaces a few keys still gives the same tokens; with these weights it does not.
    Decode with the config of `tiny` or test_engine's `llama` (equal but for the name): the
    programs compiled for those are reused."""
    import jax
    import jax.numpy as jnp

    from eagle3kit.core.sharding import make_mesh
    from eagle3kit.io.hf import load_target, resolve_target

    directory = tmp_path_factory.mktemp("chaotic")
    model = assets.tiny_hf_model("llama", directory, initializer_range=0.3)
    mesh = make_mesh("data=1,tensor=1", jax.devices()[:1])
    return model, load_target(resolve_target(directory), mesh, jnp.float32)
