"""speculators (vLLM) export and import: what vLLM loads is what eagle3kit trained."""

from __future__ import annotations

import json
import logging

import numpy as np
import pytest

from eagle3kit.errors import InputError, MismatchError
from eagle3kit.formats import export_draft, load_any_draft
from eagle3kit.io import safetensors as st
from tests.formats import engines
from tests.formats.helpers import (
    assert_same_logits,
    engine_logits,
    jax_logits,
    make_draft,
)


@pytest.mark.parametrize("aux,nbr", [(None, False), ((5, 1, 3), False), (None, True)],
                         ids=["default", "custom-unordered-layers", "norm-before-residual"])
def test_vllm_runs_the_draft_eagle3kit_trained(target, tokens, tmp_path, aux, nbr):
    d = make_draft(target, aux_layer_ids=aux, norm_before_residual=nbr, seed=4)
    out = export_draft(d, "speculators", tmp_path / "v", dtype="float32")
    engine = engines.load_vllm(out, target.num_layers)
    assert_same_logits(engine_logits(engine, target, tokens), jax_logits(d, target, tokens))


def test_config_fields(target, tmp_path):
    d = make_draft(target, aux_layer_ids=(1, 3, 4))
    out = export_draft(d, "speculators", tmp_path / "v", speculative_tokens=5)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["speculators_model_type"] == "eagle3"
    assert cfg["architectures"] == ["Eagle3Speculator"]
    # vLLM reads a missing key as true: always written
    assert cfg["norm_before_residual"] is False
    assert cfg["eagle_aux_hidden_state_layer_ids"] == [1, 3, 4]  # hidden_states indices
    assert cfg["draft_vocab_size"] == 40 and cfg["target_hidden_size"] == 32
    assert not (cfg["norm_before_fc"] or cfg["fc_norm"] or cfg["norm_output"])
    layer = cfg["transformer_layer_config"]
    # speculators reads a layer config without model_type as Qwen3
    assert layer["model_type"] == "llama" and layer["vocab_size"] == 96
    assert layer["max_position_embeddings"] == 256 and layer["tie_word_embeddings"] is False
    assert layer["rope_scaling"]["rope_type"] == "llama3"
    spec = cfg["speculators_config"]
    assert spec["algorithm"] == "eagle3" and spec["default_proposal_method"] == "greedy"
    assert spec["proposal_methods"] == [{"proposal_type": "greedy", "speculative_tokens": 5,
                                         "verifier_accept_k": 1, "accept_tolerance": 0.0}]
    assert spec["verifier"] == {"name_or_path": "org/tiny-llama",
                                "architectures": ["LlamaForCausalLM"]}
    names = st.SafetensorsFile(out / "model.safetensors").names
    assert "layers.0.self_attn.q_proj.weight" in names and not any("midlayer" in n
                                                                   for n in names)


def test_target_name_is_required_and_overridable(target, tmp_path):
    d = make_draft(target, name="")
    with pytest.raises(MismatchError, match="--target-name"):
        export_draft(d, "speculators", tmp_path / "a")
    out = export_draft(d, "speculators", tmp_path / "b", target_name="org/real-id")
    verifier = json.loads((out / "config.json").read_text())["speculators_config"]["verifier"]
    assert verifier["name_or_path"] == "org/real-id"


def test_local_verifier_path_warns(target, tmp_path, caplog):
    d = make_draft(target, name=str(target.directory))
    with caplog.at_level(logging.WARNING, logger="eagle3kit"):
        export_draft(d, "speculators", tmp_path / "v")
    assert "not a Hub id" in caplog.text


def _foreign(target, tmp_path, **edits):
    d = make_draft(target, seed=8)
    out = export_draft(d, "speculators", tmp_path / "foreign", dtype="float32")
    (out / "eagle3kit.json").unlink()
    cfg = json.loads((out / "config.json").read_text())
    for k, v in edits.items():
        if v is None:
            cfg.pop(k)
        else:
            cfg[k] = v
    (out / "config.json").write_text(json.dumps(cfg))
    return d, out


def test_missing_norm_before_residual_reads_as_vllm_does(target, tmp_path):
    d, out = _foreign(target, tmp_path, norm_before_residual=None)
    back = load_any_draft(out, target=str(target.directory))
    assert back.config.norm_before_residual is True  # vLLM's default when absent
    assert back.target_name == "org/tiny-llama"  # the verifier recorded in the config


def test_import_without_any_target_source(target, tmp_path):
    _, out = _foreign(target, tmp_path)
    # the verifier id cannot be fetched offline: the error says how to proceed
    with pytest.raises(InputError, match="pass --target"):
        load_any_draft(out)


def test_import_checks_the_target(target, tmp_path):
    _, out = _foreign(target, tmp_path, eagle_aux_hidden_state_layer_ids=[2, 3, 9])
    with pytest.raises(MismatchError, match=r"do not fit the 8-layer target.*\[9\]"):
        load_any_draft(out, target=str(target.directory))
    other = tmp_path / "other-target"  # only config.json is read: a target with 128 tokens
    other.mkdir()
    (other / "config.json").write_text(json.dumps({**target.hf_config, "vocab_size": 128}))
    _, out = _foreign(target, tmp_path / "b")
    with pytest.raises(MismatchError, match="vocab sizes disagree.*target 128"):
        load_any_draft(out, target=str(other))


def test_listed_layer_order_is_read_as_vllm_captures(target, tmp_path):
    # vLLM appends the captured states in layer order, whatever the list says
    _, out = _foreign(target, tmp_path, eagle_aux_hidden_state_layer_ids=[5, 1, 3])
    assert load_any_draft(out, target=str(target.directory)).config.aux_layer_ids == (1, 3, 5)


def test_qk_norm_and_other_flags_are_refused(target, tmp_path):
    _, out = _foreign(target, tmp_path, norm_before_fc=True)
    with pytest.raises(InputError, match="norm_before_fc"):
        load_any_draft(out, target=str(target.directory))
    # EAGLE-3.1's norm_output alone is a draft eagle3kit runs, named by its flags
    _, out = _foreign(target, tmp_path / "n", norm_output=True)
    assert load_any_draft(out, target=str(target.directory)).config.arch == "eagle3+norm_output"
    _, out = _foreign(target, tmp_path / "b")
    tensors, meta = st.load(out / "model.safetensors")
    tensors["layers.0.self_attn.q_norm.weight"] = np.ones(8, np.float32)
    st.save(out / "model.safetensors", tensors, meta)
    with pytest.raises(InputError, match="q/k norms"):
        load_any_draft(out, target=str(target.directory))
