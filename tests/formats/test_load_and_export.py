"""`load_any_draft` / `export_draft` / `detect_format`: detection, refusals, atomic output."""

from __future__ import annotations

import dataclasses
import json
import time

import numpy as np
import pytest

from eagle3kit.errors import InputError, MismatchError
from eagle3kit.formats import detect_format, export_draft, load_any_draft
from eagle3kit.io.draft_io import save_draft
from tests.formats.helpers import make_draft


@pytest.fixture(scope="module")
def exports(target, tmp_path_factory):
    root = tmp_path_factory.mktemp("exports")
    d = make_draft(target)
    save_draft(root / "own", d)
    export_draft(d, "sglang", root / "sglang")
    export_draft(d, "speculators", root / "speculators")
    return root


@pytest.mark.parametrize("fmt", ["eagle3kit", "sglang", "speculators"])
def test_detects_each_format(exports, fmt):
    assert detect_format(exports / ("own" if fmt == "eagle3kit" else fmt)) == fmt


def test_unknown_and_ambiguous_formats(exports, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    with pytest.raises(InputError, match=r"unknown draft format \(architectures "
                                         r"\['LlamaForCausalLM'\]\).*found config.json"):
        detect_format(tmp_path)
    both = json.loads((exports / "sglang" / "config.json").read_text())
    both["speculators_model_type"] = "eagle3"
    (tmp_path / "config.json").write_text(json.dumps(both))
    with pytest.raises(InputError, match="ambiguous draft format.*speculators and sglang.*--from"):
        detect_format(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(InputError, match=r"config.json: invalid JSON"):
        detect_format(tmp_path)


def test_sources_that_are_not_drafts(exports, tmp_path):
    with pytest.raises(InputError, match="a draft is a directory"):
        load_any_draft(exports / "sglang" / "config.json")
    with pytest.raises(InputError, match="no such draft"):
        load_any_draft(tmp_path / "missing")
    # a Hub id is tried, and offline that fails at once with one line naming it and saying
    # it is neither a directory nor reachable (`eval --draft typo/final`)
    t0 = time.perf_counter()
    with pytest.raises(InputError, match="org/no-such-draft: no such directory, and the draft "
                       "is not in the local Hub cache; the Hub cannot be reached"):
        load_any_draft("org/no-such-draft")
    assert time.perf_counter() - t0 < 5


def test_existing_output_is_refused_and_kept(exports, target, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    d = make_draft(target)
    with pytest.raises(FileExistsError):
        export_draft(d, "sglang", out)
    assert (out / "keep.txt").read_text() == "mine"
    export_draft(d, "sglang", out, force=True)
    assert not (out / "keep.txt").exists() and (out / "model.safetensors").exists()


def _no_trace(parent, name):
    """Nothing at `name` and no temporary sibling left behind."""
    return not any(p.name == name or p.name.startswith(f".{name}.") for p in parent.iterdir())


@pytest.mark.parametrize("fmt", ["sglang", "speculators"])
def test_checks_run_before_anything_is_written(target, tmp_path, fmt):
    d = make_draft(target)
    tc = d.target_config
    cases = {
        "target cannot be determined": dataclasses.replace(d, target_config={}),
        "do not fit the 3-layer target": dataclasses.replace(
            d, target_config={**tc, "num_hidden_layers": 3}),
        "vocab sizes disagree": dataclasses.replace(d, target_config={**tc, "vocab_size": 97}),
        "repeat a layer": make_draft(target, aux_layer_ids=(2, 3, 3)),
        "hidden size": dataclasses.replace(d, target_config={**tc, "hidden_size": 64,
                                                             "head_dim": 8}),
    }
    bad = dataclasses.replace(d.weights, fc=np.full_like(d.weights.fc, np.nan))
    cases["non-finite"] = dataclasses.replace(d, weights=bad)
    for message, draft in cases.items():
        with pytest.raises(MismatchError, match=message):
            export_draft(draft, fmt, tmp_path / "out")
        assert _no_trace(tmp_path, "out"), message


def test_sglang_needs_layer_ids_above_zero(target, tmp_path):
    d = make_draft(target, aux_layer_ids=(0, 2, 4))  # the embeddings: vLLM can, SGLang can't
    with pytest.raises(MismatchError, match=r"\[0\] outside 1..7"):
        export_draft(d, "sglang", tmp_path / "sg")
    export_draft(d, "speculators", tmp_path / "v")


def test_dtype_and_format_names(target, tmp_path):
    d = make_draft(target)
    with pytest.raises(InputError, match="--dtype 'int8': choose bfloat16, float16, float32"):
        export_draft(d, "sglang", tmp_path / "a", dtype="int8")
    with pytest.raises(InputError, match="unknown format 'gguf'"):
        export_draft(d, "gguf", tmp_path / "a")
    export_draft(d, "sglang", tmp_path / "fp16", dtype="fp16")
    cfg = json.loads((tmp_path / "fp16" / "config.json").read_text())
    assert cfg["torch_dtype"] == "float16"


def test_eagle3kit_import_with_a_target_override(exports, target):
    d = load_any_draft(exports / "own", target=str(target.directory), target_name="org/x")
    assert d.target_name == "org/x" and d.target_config["num_hidden_layers"] == 8
