"""The draft-architecture registry as docs/architecture.md's "How to add a draft architecture"
describes it: the doc's toy, registered here and nowhere in src, names itself in `train
--help`'s text, round-trips through `convert` in the one engine format it maps, is refused in one
line by the format it cannot be written in, and the model card names it; the built-in
architectures register the way the doc says."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from eagle3kit.cli.app import app
from eagle3kit.core import arches
from eagle3kit.core.draft import arrays as draft_arrays
from eagle3kit.formats import load_any_draft
from eagle3kit.hub.card import render_card
from eagle3kit.io.draft_io import load_draft, save_draft
from tests import doc_examples
from tests.formats.helpers import make_draft

ROOT = Path(__file__).resolve().parents[2]
SECTION = "### How to add a draft architecture"
LINE = re.compile(r'^\s*register\("([\w.-]+)", "([^"]+)", "eagle3kit\.core\.(\w+)",'
                  r'\s*summary="([^"]+)"\)$', re.M)


def cli(*args):
    return CliRunner().invoke(app, list(map(str, args)), env={"COLUMNS": "250"})


@pytest.fixture
def toy():
    section = doc_examples.doc_section(SECTION)
    module = doc_examples.doc_module(SECTION, "toy_draft_from_docs")
    (name, display, _, summary), = LINE.findall(section)
    arches.register(name, display, module, summary=summary)
    yield name
    arches.unregister(name)


def test_toy_draft_through_train_help_convert_and_card(toy, target, tmp_path):
    # what `train --help` shows (read when the CLI module loads, so asked here directly)
    assert "; toy (EAGLE3 under another name)." in arches.help_text()
    d = make_draft(target, arch=toy)
    assert d.config.method == "toy" and d.config.arch == toy
    final = save_draft(tmp_path / "final", d)
    assert json.loads((final / "draft_config.json").read_text())["draft"]["method"] == "toy"
    r = cli("convert", final, "--to", "speculators", "-o", tmp_path / "v")
    assert r.exit_code == 0, r.output
    config = json.loads((tmp_path / "v" / "config.json").read_text())
    assert config["speculators_model_type"] == "toy"
    assert config["speculators_config"]["algorithm"] == "toy"
    back = load_any_draft(tmp_path / "v", target=str(target.directory))
    assert back.config.arch == toy and back.config == d.config
    for field, value in draft_arrays(d.weights).items():
        np.testing.assert_allclose(getattr(back.weights, field), value, rtol=1e-2, atol=1e-2)
    # the format it has no mapping for: one line naming what it can be written in, exit 3
    r = cli("convert", final, "--to", "sglang", "-o", tmp_path / "sg")
    assert r.exit_code == 3, r.output
    assert r.output.strip().splitlines()[-1] == (
        "error: the toy draft cannot be written in the SGLang format; choose speculators or "
        "eagle3kit")
    assert not (tmp_path / "sg").exists()
    card = render_card(tmp_path / "v", "org/toy-draft")
    assert "trained with the Toy draft method" in card and "# Toy draft head for" in card
    assert load_draft(final).config.arch == toy


def test_an_unregistered_architecture_is_refused(target, tmp_path):
    r = cli("train", "--target", target.directory, "--data", tmp_path / "none.jsonl",
            "--vocab", tmp_path / "v.safetensors", "--out", tmp_path / "run", "--arch", "toy")
    assert r.exit_code == 2 and "--arch 'toy': choose eagle3, eagle3.1, eagle3.1-fc" \
        in r.output, r.output


def test_builtin_architectures_register_as_the_doc_says():
    r = cli("train", "--help")
    assert r.exit_code == 0 and all(name in r.output for name in arches.names()), r.output
    source = (ROOT / "src" / "eagle3kit" / "core" / "arches.py").read_text()
    lines = re.findall(r'^register\("([\w.-]+)", "([^"]+)", "eagle3kit\.core\.(\w+)"',
                       source, re.M)
    assert [name for name, _, _ in lines] == list(arches.names())
    for name, display, _ in lines:
        impl = arches.get(name).impl
        assert all(hasattr(impl, hook) for hook in
                   ("Weights", "export_keys", "export_fields", "read_flags")), name
        assert arches.display(name) == display
