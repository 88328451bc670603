"""The engine's pre-flight memory estimate of its KV caches (what `regenerate` and `eval`
refuse a run by, exit 4, before allocating anything) against the bytes the caches take."""

from __future__ import annotations

import jax
import pytest

from eagle3kit.decode.engine import Engine, EngineConfig
from eagle3kit.decode.speculative import DecodeConfig
from tests.decode import engines


def _allocated(tree) -> int:
    return sum(x.nbytes for x in jax.tree.leaves(tree))


def test_the_memory_estimate_of_the_caches_is_what_they_allocate(tiny):
    """`Engine.memory["cache"]` equals the bytes of the arrays the engine then allocates: the
    target's keys and values at every layer, row and slot, and with a draft its own cache
    too. Half of it (the keys alone, say) would let runs through that cannot fit."""
    tcfg, tw, dcfg, dw, vocab, mesh = tiny
    plain = Engine(tcfg, tw, mesh, [], EngineConfig(rows=8, max_context=384))
    assert plain.dcache is None and plain.cache_bytes == plain.memory["cache"]
    assert plain.memory["cache"] == pytest.approx(_allocated(plain.cache), rel=0.01)
    dec = DecodeConfig(steps=2, max_new_tokens=8)
    spec = engines.speculative(tcfg, tw, dcfg, dw, vocab, dec, [], mesh, rows=8,
                               max_context=384)
    draft = _allocated(spec.dcache)
    assert draft > 0
    assert spec.memory["cache"] == pytest.approx(_allocated(spec.cache) + draft, rel=0.01)
    assert spec.memory["cache"] - plain.memory["cache"] == pytest.approx(draft, rel=0.01)
