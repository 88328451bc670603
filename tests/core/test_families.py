"""Qwen3-MoE, gpt-oss and Gemma-3: fp32 parity with transformers' forward (logits and every
captured hidden state) on one device and on a simulated mesh that splits heads and experts.

The tiny models cover what distinguishes each family: routed experts with a dense layer in
the stack (Qwen3-MoE), sliding windows shorter than the sequence, attention sinks, YaRN,
biased router and clamped SwiGLU (gpt-oss), two rope bases, (1 + w) norms, post norms, query
scaling, scaled embeddings and a tied head (Gemma-3). Tolerance as in test_target.py.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from eagle3kit.core import target
from eagle3kit.core.sharding import make_mesh, use_mesh
from eagle3kit.io.hf import load_target, resolve_target
from tests import assets
from tests.core.test_target import assert_close, torch_reference

FAMILIES = ["qwen3_moe", "gpt_oss", "gemma3"]


def jax_forward(ckpt, mesh, tokens, aux_ids):
    w = load_target(ckpt, mesh, jnp.float32)
    cfg = ckpt.config

    @jax.jit
    def run(w, tokens):
        out = target.forward(w, cfg, tokens, aux_layer_ids=aux_ids)
        return target.logits(w, out.hidden_BxTxD), out.aux_BxTxA

    with use_mesh(mesh):
        logits, aux = run(w, jnp.asarray(tokens))
    d = cfg.hidden_size
    aux = np.asarray(aux)
    return w, np.asarray(logits), [aux[..., j * d:(j + 1) * d] for j in range(aux.shape[-1] // d)]


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("mesh_spec", ["data=1,tensor=1", "data=4,tensor=2"])
def test_parity(family, mesh_spec, tmp_path):
    model = assets.tiny_hf_model(family, tmp_path)
    ckpt = resolve_target(tmp_path)
    cfg = ckpt.config
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, size=(4, 70))
    aux_ids = (0, 1, 2, 3)  # every layer's input: dense, sparse, local and global layers
    ref_logits, ref_aux = torch_reference(model, tokens, aux_ids)
    devices = jax.devices()[:1] if mesh_spec.startswith("data=1") else jax.devices()
    w, logits, aux = jax_forward(ckpt, make_mesh(mesh_spec, devices), tokens, aux_ids)
    assert_close(logits, ref_logits, f"{family} logits")
    for i, a, r in zip(aux_ids, aux, ref_aux, strict=True):
        assert_close(a, r, f"{family} hidden_states[{i}]")
    if cfg.moe is not None and mesh_spec != "data=1,tensor=1":
        gate = w.experts.gate  # Ls, E, D, F with E split over the mesh
        assert {s.data.shape[1] for s in gate.addressable_shards} == {cfg.moe.num_experts // 2}


def test_configs_read_the_family_features(tmp_path):
    for family in FAMILIES:
        assets.tiny_hf_model(family, tmp_path / family)
    moe = resolve_target(tmp_path / "qwen3_moe").config
    assert moe.moe.sparse_layers == (True, True, False, True) and moe.moe.norm_topk_prob
    oss = resolve_target(tmp_path / "gpt_oss").config
    assert oss.layer_windows == (8, 0, 8, 0) and oss.attention_sinks
    assert oss.rope.kind == "yarn" and oss.moe.routing == "topk_softmax" and oss.moe.bias
    gemma = resolve_target(tmp_path / "gemma3").config
    assert gemma.layer_rope_index() == (1, 0, 1, 0) and gemma.tie_word_embeddings
    assert (gemma.rope.theta, gemma.rope.kind, gemma.local_rope.theta) == (1e6, "linear", 1e4)
    assert gemma.query_scale == pytest.approx(24 ** -0.5)
