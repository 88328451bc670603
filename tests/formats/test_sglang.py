"""SGLang (midlayer) export and import: what SGLang loads is what eagle3kit trained."""

from __future__ import annotations

import json
import logging

import numpy as np
import pytest
import torch

from eagle3kit.core.draft import arrays as draft_arrays
from eagle3kit.errors import InputError, MismatchError
from eagle3kit.formats import export_draft, load_any_draft, sglang
from eagle3kit.io import safetensors as st
from tests import assets
from tests.formats import engines
from tests.formats.helpers import (
    assert_same_logits,
    engine_logits,
    jax_logits,
    make_draft,
    tiny_target,
)


@pytest.mark.parametrize("aux,arch", [(None, "eagle3"), ((5, 1, 3), "eagle3"),
                                      (None, "eagle3.1"), (None, "eagle3.1-fc")],
                         ids=["default-layers", "custom-unordered-layers", "eagle3.1",
                              "eagle3.1-fc"])
def test_sglang_runs_the_draft_eagle3kit_trained(target, tokens, tmp_path, aux, arch):
    d = make_draft(target, aux_layer_ids=aux, arch=arch)
    out = export_draft(d, "sglang", tmp_path / "sg", dtype="float32")
    engine = engines.load_sglang(out, target.num_layers)
    assert_same_logits(engine_logits(engine, target, tokens), jax_logits(d, target, tokens))


def test_qwen3_target_gets_a_llama_draft(tokens, tmp_path):
    qwen3 = tiny_target(tmp_path / "qwen3", "qwen3")
    d = make_draft(qwen3, name="Qwen/Qwen3-tiny")
    out = export_draft(d, "sglang", tmp_path / "sg", dtype="float32")
    cfg = json.loads((out / "config.json").read_text())
    # the target ties its embeddings and has head_dim 16 != 32 / 4: neither may leak wrongly
    assert cfg["model_type"] == "llama" and cfg["tie_word_embeddings"] is False
    assert cfg["head_dim"] == 16 and cfg["rope_theta"] == 1e6
    engine = engines.load_sglang(out, qwen3.num_layers)
    assert_same_logits(engine_logits(engine, qwen3, tokens), jax_logits(d, qwen3, tokens))


def test_vllm_runs_the_midlayer_export_too(target, tokens, tmp_path):
    d = make_draft(target, seed=2)
    out = export_draft(d, "sglang", tmp_path / "sg", dtype="float32")
    engine = engines.load_vllm(out, target.num_layers)
    assert_same_logits(engine_logits(engine, target, tokens), jax_logits(d, target, tokens))


def test_bf16_export_dtypes_and_logits(target, tokens, tmp_path):
    d = make_draft(target, seed=3)
    out = export_draft(d, "sglang", tmp_path / "sg")  # bfloat16 is the default
    f = st.SafetensorsFile(out / "model.safetensors")
    dtypes = {n: f._header[n]["dtype"] for n in f.names}
    assert dtypes.pop("d2t") == "I64" and dtypes.pop("t2d") == "BOOL"
    assert set(dtypes.values()) == {"BF16"} and len(dtypes) == 13
    assert not any("embed_tokens" in n for n in f.names)
    # the engine computes with what was written: compare against the bf16-rounded draft
    rounded = load_any_draft(out)
    engine = engines.load_sglang(out, target.num_layers)
    assert_same_logits(engine_logits(engine, target, tokens), jax_logits(rounded, target, tokens))


def test_config_fields(target, tmp_path):
    d = make_draft(target)
    cfg = json.loads((export_draft(d, "sglang", tmp_path / "a") / "config.json").read_text())
    hf = assets.TINY["llama"]
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["model_type"] == "llama"
    assert cfg["num_hidden_layers"] == 1 and cfg["tie_word_embeddings"] is False
    assert (cfg["vocab_size"], cfg["draft_vocab_size"]) == (96, 40)
    assert cfg["max_position_embeddings"] == hf["max_position_embeddings"] == 256
    assert target.hf_config["max_position_embeddings"] == 256
    assert cfg["rope_theta"] == hf["rope_theta"]
    assert cfg["rope_scaling"] == {k: hf["rope_scaling"][k] for k in (
        "rope_type", "factor", "low_freq_factor", "high_freq_factor",
        "original_max_position_embeddings")}
    assert cfg["rope_parameters"]["rope_type"] == "llama3"
    assert cfg["head_dim"] == 8 and cfg["target_hidden_size"] == 32
    assert cfg["norm_before_residual"] is False and cfg["torch_dtype"] == "bfloat16"
    assert "eagle_config" not in cfg  # default layers: every reader agrees without it
    assert "fc_norm" not in cfg and "norm_output" not in cfg  # EAGLE3: as before EAGLE-3.1
    cfg = json.loads((export_draft(make_draft(target, arch="eagle3.1"), "sglang",
                                   tmp_path / "v31") / "config.json").read_text())
    assert cfg["fc_norm"] is True and cfg["norm_output"] is True  # SGLang's top-level keys
    custom = make_draft(target, aux_layer_ids=(1, 3, 4))
    cfg = json.loads((export_draft(custom, "sglang", tmp_path / "b") / "config.json")
                     .read_text())
    # SGLang ids are "output of layer": HF hidden_states index - 1
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [0, 2, 3]


@pytest.mark.parametrize("fmt,arch", [("sglang", "eagle3"), ("speculators", "eagle3"),
                                      ("sglang", "eagle3.1"), ("sglang", "eagle3.1-fc")])
def test_round_trip_is_bit_exact(target, tmp_path, fmt, arch):
    d = make_draft(target, aux_layer_ids=(2, 3, 5), training={"epochs": 3, "lr": 3e-4},
                   arch=arch)
    back = load_any_draft(export_draft(d, fmt, tmp_path / "x", dtype="float32"))
    assert back.config == d.config and back.target_name == d.target_name
    assert back.target_config == d.target_config and back.training == d.training
    assert back.fingerprints == d.fingerprints
    for f in draft_arrays(d.weights):
        a, b = np.asarray(getattr(d.weights, f)), np.asarray(getattr(back.weights, f))
        assert a.dtype == b.dtype == np.float32 and np.array_equal(a, b), f
    np.testing.assert_array_equal(back.vocab.d2t, d.vocab.d2t)
    np.testing.assert_array_equal(back.vocab.t2d, d.vocab.t2d)
    # bf16: the first trip rounds, the second is exact
    once = load_any_draft(export_draft(back, fmt, tmp_path / "b1"))
    export_draft(once, fmt, tmp_path / "b2")
    assert ((tmp_path / "b1" / "model.safetensors").read_bytes()
            == (tmp_path / "b2" / "model.safetensors").read_bytes())


def test_norm_before_residual_is_refused(target, tmp_path):
    d = make_draft(target, norm_before_residual=True)
    with pytest.raises(MismatchError, match="--to speculators"):
        export_draft(d, "sglang", tmp_path / "sg")
    assert not (tmp_path / "sg").exists()


def _foreign(target, tmp_path, *, drop_sidecar=True, **edits):
    """A midlayer checkpoint as other tools publish it: no eagle3kit sidecar."""
    d = make_draft(target, seed=5)
    out = export_draft(d, "sglang", tmp_path / "foreign", dtype="float32")
    if drop_sidecar:
        (out / "eagle3kit.json").unlink()
    cfg = json.loads((out / "config.json").read_text())
    cfg.update(edits)
    (out / "config.json").write_text(json.dumps(cfg))
    return d, out


def test_import_needs_the_target(target, tmp_path):
    d, out = _foreign(target, tmp_path)
    with pytest.raises(MismatchError, match="pass --target"):
        load_any_draft(out)
    back = load_any_draft(out, target=str(target.directory))
    assert back.config == d.config and back.target_name == str(target.directory)


def test_import_reads_sglang_layer_convention(target, tmp_path):
    _, out = _foreign(target, tmp_path, eagle_config={"eagle_aux_hidden_state_layer_ids":
                                                      [0, 2, 4]})
    back = load_any_draft(out, target=str(target.directory))
    assert back.config.aux_layer_ids == (1, 3, 5)
    cfg = json.loads((out / "config.json").read_text())
    cfg["eagle_aux_hidden_state_layer_ids"] = [0, 2, 4]  # vLLM's convention, contradicting
    (out / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(InputError, match="ambiguous capture layers"):
        load_any_draft(out, target=str(target.directory))


def test_import_pytorch_bin_and_embed_tokens(target, tmp_path, caplog):
    d, out = _foreign(target, tmp_path)
    tensors, _ = st.load(out / "model.safetensors")
    (out / "model.safetensors").unlink()
    state = {k: torch.from_numpy(np.array(v)) for k, v in tensors.items()}
    state["embed_tokens.weight"] = torch.zeros(96, 32, dtype=torch.float16)
    torch.save(state, out / "pytorch_model.bin")
    with caplog.at_level(logging.WARNING, logger="eagle3kit"):
        back = load_any_draft(out, target=str(target.directory))
    assert "ignoring embed_tokens.weight" in caplog.text
    for f in draft_arrays(d.weights):
        assert np.array_equal(getattr(back.weights, f), getattr(d.weights, f)), f


def test_import_refuses_what_it_cannot_run(target, tmp_path):
    d, out = _foreign(target, tmp_path)
    tensors, meta = st.load(out / "model.safetensors")
    st.save(out / "model.safetensors", {k: v for k, v in tensors.items() if k != "d2t"}, meta)
    with pytest.raises(InputError, match="missing tensor 'd2t'"):
        load_any_draft(out, target=str(target.directory))
    st.save(out / "model.safetensors", {**tensors, "midlayer.extra.weight": np.zeros(3)}, meta)
    with pytest.raises(InputError, match="do not belong"):
        load_any_draft(out, target=str(target.directory))
    st.save(out / "model.safetensors", tensors, meta)
    for edit, message in [({"tie_word_embeddings": True}, "tie_word_embeddings"),
                          ({"num_hidden_layers": 2}, "one-layer"),
                          ({"norm_before_fc": True}, "norm_before_fc")]:
        cfg = json.loads((out / "config.json").read_text())
        (out / "config.json").write_text(json.dumps({**cfg, **edit}))
        with pytest.raises(InputError, match=message):
            load_any_draft(out, target=str(target.directory))
        (out / "config.json").write_text(json.dumps(cfg))


def test_import_reads_every_spelling_sglang_loads(target, tmp_path):
    """SGLang's load_weights also takes a `model.` prefix, `layers.0.` and the legacy
    `aux_norm_low/mid/high` names (with the legacy `use_aux_norm` flag): the same draft."""
    d = make_draft(target, arch="eagle3.1", seed=6)
    out = export_draft(d, "sglang", tmp_path / "e", dtype="float32")
    (out / "eagle3kit.json").unlink()
    tensors, meta = st.load(out / "model.safetensors")
    legacy = {"fc_norm.0.": "aux_norm_low.", "fc_norm.1.": "aux_norm_mid.",
              "fc_norm.2.": "aux_norm_high.", "midlayer.": "model.layers.0."}
    renamed = {}
    for name, value in tensors.items():
        new = next((name.replace(a, b) for a, b in legacy.items() if name.startswith(a)),
                   "model." + name if name == "fc.weight" else name)
        renamed[new] = value
    assert "aux_norm_mid.weight" in renamed and "model.fc.weight" in renamed
    st.save(out / "model.safetensors", renamed, meta)
    cfg = json.loads((out / "config.json").read_text())
    del cfg["fc_norm"]
    (out / "config.json").write_text(json.dumps({**cfg, "use_aux_norm": True}))
    back = load_any_draft(out, target=str(target.directory))
    assert back.config == d.config and back.config.arch == "eagle3.1"
    for f in draft_arrays(d.weights):
        assert np.array_equal(getattr(back.weights, f), getattr(d.weights, f)), f
    st.save(out / "model.safetensors", {**renamed, "fc_norm.1.weight": tensors[
        "fc_norm.1.weight"]}, meta)
    with pytest.raises(InputError, match="'fc_norm.1.weight' appears twice"):
        load_any_draft(out, target=str(target.directory))


def test_import_reads_norm_output_as_sglang_does(target, tmp_path):
    # SGLang 0.5.23: false (its default) carries the pre-norm state, the standard EAGLE3
    d, out = _foreign(target, tmp_path, norm_output=False)
    assert load_any_draft(out, target=str(target.directory)).config == d.config
    # true alone: the post-norm state carried, without fc norms
    _, out = _foreign(target, tmp_path / "n", norm_output=True)
    assert load_any_draft(out, target=str(target.directory)).config.arch == "eagle3+norm_output"
    # fc norm tensors without the flag: SGLang would skip them silently, eagle3kit refuses
    d = make_draft(target, arch="eagle3.1")
    out = export_draft(d, "sglang", tmp_path / "f", dtype="float32")
    cfg = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**cfg, "fc_norm": False}))
    with pytest.raises(InputError, match="do not belong"):
        load_any_draft(out)


def test_sglang_ids_helpers():
    assert sglang.to_sglang_ids((2, 15, 27)) == [1, 14, 26]
    assert sglang.from_sglang_ids([1, 14, 26]) == (2, 15, 27)
