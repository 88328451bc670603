"""A tiny random target and draft shared by the decode tests (built once)."""

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
