"""One tiny Llama target (transformers + eagle3kit) shared by the format tests."""

from __future__ import annotations

import pytest

from tests.formats.helpers import tiny_target


@pytest.fixture(scope="session")
def target(tmp_path_factory):
    return tiny_target(tmp_path_factory.mktemp("target"))


@pytest.fixture(scope="session")
def tokens():
    """[B, T] token ids, one shape for every test: the JAX target compiles once."""
    import numpy as np

    return np.random.default_rng(7).integers(0, 96, size=(2, 11))
