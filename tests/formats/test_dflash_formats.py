"""DFlash drafts through `convert`: the speculators export loads in speculators 0.9.0's own
`DFlashDraftModel` with no missing or unexpected keys and holds our weights; the SGLang export
is what SGLang 0.5.23's `DFlashDraftModel` builds and loads (every parameter written, nothing
skipped); both read back to the same draft; and what a format cannot express, or a published
block method eagle3kit does not run, is one line."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from eagle3kit.core import dflash
from eagle3kit.core.config import DraftConfig
from eagle3kit.core.draft import arrays
from eagle3kit.core.vocab import VocabMap
from eagle3kit.formats import export_draft, load_any_draft
from eagle3kit.io.draft_io import Draft, save_draft
from tests.core.test_dflash import weights as from_state_dict
from tests.formats.test_toy_draft import cli

RUNNER = Path(__file__).with_name("sglang_dflash_runner.py")


def make_dflash(t, draft_vocab: int | None = None, layers: int = 2, seed: int = 0) -> Draft:
    tcfg = t.ckpt.config
    cfg = dataclasses.replace(
        DraftConfig.for_target(tcfg, draft_vocab or tcfg.vocab_size).with_arch("dflash"),
        num_layers=layers, block_size=4, mask_token_id=5)
    rng = np.random.default_rng(seed)
    values = {k: (1 + 0.3 * rng.standard_normal(i.shape) if k.endswith("norm")
                  else rng.standard_normal(i.shape) / np.sqrt(i.shape[-2 if k == "o" else 1]))
              for k, i in arrays(dflash.DFlashWeights.abstract(cfg)).items()}
    w = dflash.DFlashWeights(**{k: v.astype(np.float32) for k, v in values.items()})
    if draft_vocab:
        vocab = VocabMap.from_ids(rng.choice(cfg.vocab_size, draft_vocab, replace=False),
                                  cfg.vocab_size)
    else:
        vocab = VocabMap.identity(cfg.vocab_size)
    return Draft(cfg, w, vocab, "org/tiny-llama", dict(t.hf_config), {"tokenizer": "96:test"},
                 {})


def assert_same(a: Draft, b: Draft) -> None:
    assert a.config == b.config
    for field, value in arrays(a.weights).items():
        np.testing.assert_allclose(getattr(b.weights, field), value, rtol=1e-6, atol=1e-7)
    np.testing.assert_array_equal(a.vocab.used_ids, b.vocab.used_ids)


@pytest.mark.parametrize("draft_vocab", [None, 40])
def test_speculators_export_loads_in_speculators_with_our_weights(target, tmp_path,
                                                                  draft_vocab, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    from speculators.models.dflash import DFlashDraftModel
    d = make_dflash(target, draft_vocab)
    out = export_draft(d, "speculators", tmp_path / "spec", dtype="float32")
    config = json.loads((out / "config.json").read_text())
    assert config["speculators_model_type"] == "dflash" and config["block_size"] == 4
    assert config["aux_hidden_state_layer_ids"] == list(d.config.aux_layer_ids)
    assert config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 3
    model, info = DFlashDraftModel.from_pretrained(str(out), output_loading_info=True)
    assert not any(info.values()), info
    assert model.use_draft_vocab == (draft_vocab is not None)
    sd = {k: v.detach().numpy() for k, v in model.state_dict().items()}
    ours = from_state_dict(d.config, sd)
    for field, value in arrays(d.weights).items():
        if field != "lm_head":
            np.testing.assert_array_equal(getattr(ours, field), value)
    if draft_vocab:
        np.testing.assert_array_equal(sd["lm_head.weight"].T, d.weights.lm_head)
        np.testing.assert_array_equal(sd["d2t"], d.vocab.d2t)
    assert_same(d, load_any_draft(out, target=str(target.directory)))


def test_sglang_export_is_what_sglangs_dflash_model_loads(target, tmp_path):
    d = make_dflash(target)
    out = export_draft(d, "sglang", tmp_path / "sg", dtype="float32")
    report_path = tmp_path / "report.json"
    subprocess.run([sys.executable, str(RUNNER), str(out), str(report_path)], check=True,
                   env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}, timeout=600)
    report = json.loads(report_path.read_text())
    assert report["architectures"] == ["DFlashDraftModel"]
    assert (report["block_size"], report["mask_token_id"], report["num_hidden_layers"]) == (4, 5, 2)
    # SGLang's ids are "the output of layer i": our HF hidden_states indices minus one
    assert report["target_layer_ids"] == [i - 1 for i in d.config.aux_layer_ids]
    assert report["unwritten"] == [] and all(report["landed"].values()), report["landed"]
    hidden = d.config.hidden_size
    assert report["parameters"]["fc.weight"] == [hidden, 3 * hidden]
    assert_same(d, load_any_draft(out, target=str(target.directory)))


def test_what_a_format_cannot_express_is_one_line(target, tmp_path):
    final = save_draft(tmp_path / "final", make_dflash(target, 40))
    r = cli("convert", final, "--to", "sglang", "-o", tmp_path / "sg")
    errors = [x for x in r.output.splitlines() if x.startswith("error:")]
    assert r.exit_code == 3 and errors == [
        "error: the dflash draft cannot be written in the SGLang format; choose speculators or "
        "eagle3kit"], r.output
    assert not (tmp_path / "sg").exists()


@pytest.mark.parametrize("change,message", [
    ({"dflash_config": {"target_layer_ids": [1, 3, 4], "mask_token_id": 5,
                        "selector_rank": 8, "selector_top_k": 4},
      "architectures": ["DFlash2DraftModel"]}, "is not DFlash"),
    ({"layer_types": ["sliding_attention", "full_attention"], "sliding_window": 8},
     "sliding-window DFlash layers are not supported"),
])
def test_a_published_block_method_eagle3kit_does_not_run_is_refused(target, tmp_path, change,
                                                                     message):
    out = export_draft(make_dflash(target), "sglang", tmp_path / "sg", dtype="float32")
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, **change}))
    r = cli("convert", out, "--to", "speculators", "-o", tmp_path / "v", "--target",
            target.directory)
    errors = [x for x in r.output.splitlines() if x.startswith("error:")]
    assert r.exit_code == 2 and len(errors) == 1 and message in errors[0], r.output
    assert not (tmp_path / "v").exists()
