"""The format registry as docs/architecture.md's "How to add an export format" describes it:
the doc's toy format, registered here and nowhere in src, runs through `eagle3kit convert`
both ways, and the built-in formats register the way the doc says."""

from __future__ import annotations

import importlib
import re
import types
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from eagle3kit.cli.app import app
from eagle3kit.core.draft import arrays as draft_arrays
from eagle3kit.formats import detect_format, registry
from eagle3kit.formats.registry import ExportOptions
from eagle3kit.io.draft_io import load_draft, save_draft
from tests import doc_examples
from tests.formats.helpers import make_draft

ROOT = Path(__file__).resolve().parents[2]
SECTION = "### How to add an export format"
# a registry line as the doc shows it and formats/__init__.py holds them
LINE = re.compile(r'^\s*register\("([\w-]+)", "([^"]+)", "eagle3kit\.formats\.(\w+)"\)$', re.M)
HOOKS = ("EXPECTS", "detect", "load", "export")


def convert(*args):
    return CliRunner().invoke(app, ["convert", *map(str, args)], env={"COLUMNS": "250"})


def doc_section() -> str:
    return doc_examples.doc_section(SECTION)


def doc_toy() -> types.ModuleType:
    """The doc's example module, executed as written."""
    return doc_examples.doc_module(SECTION, "toy_format_from_docs")


@pytest.fixture
def toy():
    (name, display, _), = LINE.findall(doc_section())
    registry.register(name, display, doc_toy())
    yield name
    registry.unregister(name)


@pytest.fixture
def run_final(target, tmp_path):
    return save_draft(tmp_path / "run" / "final", make_draft(target, name="org/tiny-llama",
                                                             training={"epochs": 1}))


def same_draft(a, b):
    assert a.config == b.config and a.target_name == b.target_name
    assert a.target_config == b.target_config
    assert np.array_equal(a.vocab.d2t, b.vocab.d2t) and np.array_equal(a.vocab.t2d, b.vocab.t2d)
    for field, value in draft_arrays(a.weights).items():
        assert np.array_equal(getattr(b.weights, field), value), field


def test_toy_format_through_convert(toy, run_final, tmp_path):
    r = convert(run_final, "--to", toy, "-o", tmp_path / "toy")
    assert r.exit_code == 0, r.output
    assert "(toy format, float32" in r.output  # its DTYPE, not --dtype's default
    assert sorted(p.name for p in (tmp_path / "toy").iterdir()) == ["toy.json", "toy.npz"]
    assert detect_format(tmp_path / "toy") == toy
    # read back by detection: exactly the draft that went in
    r = convert(tmp_path / "toy", "--to", "eagle3kit", "-o", tmp_path / "back")
    assert r.exit_code == 0, r.output
    same_draft(load_draft(run_final), load_draft(tmp_path / "back"))
    # and on to an engine format, named by --from
    r = convert(tmp_path / "toy", "--from", toy, "--to", "speculators", "-o", tmp_path / "v")
    assert r.exit_code == 0, r.output
    assert detect_format(tmp_path / "v") == "speculators"
    r = convert(run_final, "--to", "gguf", "-o", tmp_path / "x")
    assert r.exit_code == 2 and "choose one of sglang, speculators, eagle3kit, toy" in r.output


def test_an_unregistered_format_is_unknown(target, tmp_path):
    doc_toy().export(make_draft(target), tmp_path / "toy", ExportOptions())
    r = convert(tmp_path / "toy", "--to", "sglang", "-o", tmp_path / "sg")
    assert r.exit_code == 2 and "unknown draft format" in r.output, r.output
    r = convert(tmp_path / "toy", "--to", "toy", "-o", tmp_path / "again")
    assert r.exit_code == 2 and "--to 'toy'; choose one of sglang, speculators, eagle3kit" \
        in r.output, r.output


def test_builtin_formats_register_as_the_doc_says():
    source = (ROOT / "src" / "eagle3kit" / "formats" / "__init__.py").read_text()
    lines = LINE.findall(source)
    assert [name for name, _, _ in lines] == list(registry.names())
    for name, display, module in lines:
        impl = importlib.import_module(f"eagle3kit.formats.{module}")
        assert all(hasattr(impl, hook) for hook in HOOKS), name
        assert registry.get(name).display == display
