"""A tiny random target and draft shared by the decode tests (built once)."""

from __future__ import annotations

import pytest

from tests import assets


@pytest.fixture(scope="session")
def tiny(tmp_path_factory):
    """(target config, target weights, draft config, draft weights, VocabArrays, mesh)."""
    return assets.tiny_target_and_draft(tmp_path_factory.mktemp("tiny"), seed=1)
