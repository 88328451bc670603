"""`--kv-attention`: checked and resolved in one module (decode/kv_attention.py) into the one
typed value the engine reads (issue 38: it was validated in four places and its `auto`
resolved in two)."""

from __future__ import annotations

import ast
from pathlib import Path
from types import SimpleNamespace

import pytest

import eagle3kit
from eagle3kit.decode.engine import EngineConfig
from eagle3kit.decode.kv_attention import (
    KVAttention,
    check_kv_attention,
    resolve_kv_attention,
)
from eagle3kit.errors import UserError

GPU, TPU = SimpleNamespace(platform="gpu"), SimpleNamespace(platform="tpu")


def test_auto_and_the_choices_resolve_to_the_typed_value():
    assert resolve_kv_attention("auto", [GPU]) is KVAttention.PALLAS
    assert resolve_kv_attention("auto", [GPU, GPU]) is KVAttention.XLA
    assert resolve_kv_attention("auto", [TPU]) is KVAttention.XLA
    assert resolve_kv_attention("xla", [GPU]) is KVAttention.XLA
    assert resolve_kv_attention("pallas", [GPU]) is KVAttention.PALLAS
    # the engine holds the typed value whichever way it is given, and refuses the rest
    assert EngineConfig(attention="pallas").attention is KVAttention.PALLAS
    assert EngineConfig().attention is KVAttention.XLA
    with pytest.raises(ValueError, match="flash"):
        EngineConfig(attention="flash")


def test_a_bad_choice_and_the_kernel_on_a_mesh_are_one_user_error():
    with pytest.raises(UserError, match=r"^--kv-attention 'flash': choose auto, xla or pallas$"):
        check_kv_attention("flash")
    with pytest.raises(UserError, match=r"^--kv-attention 'flash'"):
        resolve_kv_attention("flash", [GPU])
    with pytest.raises(UserError, match=r"one device, not the 2 of --mesh: use --shard$"):
        resolve_kv_attention("pallas", [GPU, GPU], "use --shard")


def test_auto_is_resolved_in_one_module():
    """No module but decode/kv_attention.py picks for `auto` itself: a second place would
    drift from the first (eval's engines read the cache as regenerate's do)."""
    src = Path(eagle3kit.__file__).parent
    callers = sorted(
        str(path.relative_to(src)) for path in src.rglob("*.py")
        if path.name != "kv_attention.py"
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Call) and getattr(node.func, "id",
                                                  getattr(node.func, "attr", None))
        == "auto_kv_attention")
    assert not callers, f"auto_kv_attention called outside decode/kv_attention.py: {callers}"
