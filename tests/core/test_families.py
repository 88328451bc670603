"""Qwen3-MoE, gpt-oss and Gemma-3: fp32 parity with transformers' forward (logits and every
captured hidden state) on one device and on a simulated mesh that splits heads and experts.

The tiny models cover what distinguishes each family: routed experts with a dense layer in
the stack (Qwen3-MoE), sliding windows shorter than the sequence, attention sinks, YaRN,
biased router and clamped SwiGLU (gpt-oss), two rope bases, (1 + w) norms, post norms, query
scaling, scaled embeddings and a tied head (Gemma-3). Tolerance as in test_target.py.
"""

from __future__ import annotations

import functools
import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from eagle3kit.core import target
from eagle3kit.core.sharding import make_mesh, use_mesh
from eagle3kit.decode import row_cache
from eagle3kit.errors import InputError, UserError
from eagle3kit.io.hf import load_target, resolve_target
from tests import assets
from tests.core.test_target import assert_close, torch_reference

FAMILIES = ["qwen3_moe", "gpt_oss", "gemma3"]


def jax_forward(ckpt, mesh, tokens, aux_ids, unstacked=False):
    """`unstacked`: through the decoder's per-layer weights, q|k|v and gate|up fused (the
    stack is deleted)."""
    w = load_target(ckpt, mesh, jnp.float32)
    cfg = ckpt.config
    if unstacked:
        w = target.unstack_in_place(w, cfg)

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
    for unstacked in (True, False):  # the decoder's per-layer weights, the scanned stack
        w, logits, aux = jax_forward(ckpt, make_mesh(mesh_spec, devices), tokens, aux_ids,
                                     unstacked)
        assert_close(logits, ref_logits, f"{family} logits (unstacked={unstacked})")
        for i, a, r in zip(aux_ids, aux, ref_aux, strict=True):
            assert_close(a, r, f"{family} hidden_states[{i}] (unstacked={unstacked})")
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


def test_mxfp4_experts_dequantise_as_transformers_does(tmp_path):
    """A gpt-oss checkpoint with MXFP4 experts: our numpy dequantisation on load gives the
    forward of transformers' model holding transformers' own dequantisation of the same
    bytes."""
    import torch
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from eagle3kit.io import safetensors as st

    model = assets.tiny_hf_model("gpt_oss", tmp_path)
    tensors, _ = st.load(tmp_path / "model.safetensors")
    rng = np.random.default_rng(5)
    e, d, f = 4, 64, 32
    for i in range(4):
        prefix = f"model.layers.{i}.mlp.experts."
        for name, rows, cols in (("gate_up_proj", 2 * f, d), ("down_proj", d, f)):
            blocks = rng.integers(0, 256, (e, rows, cols // 32, 16), dtype=np.uint8)
            scales = rng.integers(119, 123, (e, rows, cols // 32), dtype=np.uint8)
            del tensors[prefix + name]
            tensors[prefix + name + "_blocks"], tensors[prefix + name + "_scales"] = blocks, scales
            param = getattr(model.model.layers[i].mlp.experts, name)
            with torch.no_grad():
                param.copy_(convert_moe_packed_tensors(torch.tensor(blocks), torch.tensor(scales),
                                                       dtype=torch.float32))
    st.save(tmp_path / "model.safetensors", tensors)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "mxfp4",
                                  "modules_to_not_convert": ["model.layers.*.self_attn"]}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    tokens = np.random.default_rng(6).integers(0, 96, size=(2, 40))
    ref_logits, _ = torch_reference(model, tokens, ())
    mesh = make_mesh("data=1", jax.devices()[:1])
    _, logits, _ = jax_forward(resolve_target(tmp_path), mesh, tokens, (1,))
    assert_close(logits, ref_logits, "gpt-oss MXFP4 logits")


def test_cached_decoding_keeps_windows_and_sinks(tmp_path):
    """forward_rows (keys from a cache row, positions from the slots) equals the full forward
    on gpt-oss, whose windows (8) are shorter than the 20 tokens."""
    assets.tiny_hf_model("gpt_oss", tmp_path)
    ckpt = resolve_target(tmp_path)
    cfg = ckpt.config
    w = load_target(ckpt, make_mesh("data=1", jax.devices()[:1]), jnp.float32)
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, cfg.vocab_size, (1, 20)))
    full = jax.jit(lambda w, t: target.forward(w, cfg, t).hidden_BxTxD)(w, tokens)
    layers = target.unstack(w, cfg)

    @functools.partial(jax.jit, static_argnums=3)
    def cached(tokens, start, cache, prefill):
        positions = start + jnp.arange(tokens.shape[1])[None]
        out, cache = row_cache.forward_rows(layers, cfg, tokens, positions, cache,
                                         prefill=prefill, window=32)
        return out.hidden_BxTxD, cache

    cache = row_cache.RowCache.zeros(cfg, 1, 32, jnp.float32)
    hidden1, cache = cached(tokens[:, :12], jnp.int32(0), cache, True)
    hidden2, cache = cached(tokens[:, 12:], jnp.int32(12), cache, False)
    assert_close(np.concatenate([hidden1, hidden2], axis=1), full, "cached hidden")


def _edit_config(directory, **changes):
    path = directory / "config.json"
    cfg = json.loads(path.read_text())
    cfg.update(changes)
    path.write_text(json.dumps(cfg))


def test_bad_input_is_one_clear_error_before_device_work(tmp_path):
    assets.tiny_hf_model("gpt_oss", tmp_path)
    _edit_config(tmp_path, model_type="llama4_text", architectures=["Llama4ForCausalLM"])
    with pytest.raises(InputError, match=r"model_type='llama4_text'.*supported: gemma3_text "
                                         r"\(Gemma3ForCausalLM\), gpt_oss \(GptOssForCausalLM\)"):
        resolve_target(tmp_path)
    _edit_config(tmp_path, model_type="gpt_oss", quantization_config={"quant_method": "fp8"})
    with pytest.raises(InputError, match="quant_method='fp8' is not understood for gpt_oss"):
        resolve_target(tmp_path)
    _edit_config(tmp_path, quantization_config={"quant_method": "mxfp4"})
    from eagle3kit.io import safetensors as st

    tensors, _ = st.load(tmp_path / "model.safetensors")
    name = "model.layers.0.mlp.experts.down_proj"
    tensors[name + "_blocks"] = np.zeros((4, 64, 1, 8), np.uint8)  # 8 bytes: not MXFP4's 16
    tensors[name + "_scales"] = np.zeros((4, 64, 1), np.uint8)
    del tensors[name]
    st.save(tmp_path / "model.safetensors", tensors)
    with pytest.raises(InputError, match="not an MXFP4 layout"):
        load_target(resolve_target(tmp_path), make_mesh("data=1", jax.devices()[:1]))
    moe_dir = tmp_path / "moe"
    assets.tiny_hf_model("qwen3_moe", moe_dir, num_key_value_heads=4, num_experts=6)
    ckpt = resolve_target(moe_dir)  # tensor=4 divides the heads, not the 6 experts
    with pytest.raises(UserError, match="experts dimension 6 is not divisible by tensor=4"):
        load_target(ckpt, make_mesh("data=2,tensor=4"), jnp.float32)


@pytest.mark.parametrize("family", FAMILIES)
def test_batched_generation_rows_match_the_full_forward(family, tmp_path):
    """forward_rows (the batched generation engine's forward: per-row positions and cache
    rows) prefilling then decoding token by token equals the full forward, with windows and
    sinks shorter than the 20 tokens and routed experts."""
    assets.tiny_hf_model(family, tmp_path)
    ckpt = resolve_target(tmp_path)
    cfg = ckpt.config
    w = load_target(ckpt, make_mesh("data=1", jax.devices()[:1]), jnp.float32)
    tokens = jnp.asarray(np.random.default_rng(2).integers(0, cfg.vocab_size, (2, 20)))
    full = jax.jit(lambda w, t: target.forward(w, cfg, t).hidden_BxTxD)(w, tokens)

    @functools.partial(jax.jit, static_argnames="prefill")
    def rows(w, tok, pos, cache, prefill=False):
        out, cache = row_cache.forward_rows(w, cfg, tok, pos, cache, prefill=prefill,
                                         window=None if prefill else 24)
        return out.hidden_BxTxD, cache

    cache = row_cache.RowCache.zeros(cfg, 2, 32, jnp.float32)
    w = target.unstack(w, cfg)
    h, cache = rows(w, tokens[:, :12], jnp.broadcast_to(jnp.arange(12), (2, 12)), cache, True)
    hidden = [h]
    for t in range(12, 20):
        h, cache = rows(w, tokens[:, t:t + 1], jnp.full((2, 1), t), cache)
        hidden.append(h)
    assert_close(np.concatenate(hidden, axis=1), full, f"{family} generated hidden")


def test_expert_parallel_step_moves_only_activations(tmp_path):
    """The compiled sharded forward of an all-MoE target: experts stay on their devices; the
    only collectives are all-reduces of the [B/data, T, D] activations over tensor pairs (the
    attention output and the MoE partial sums): no all-to-all, no all-gather of weights or
    routing results."""
    assets.tiny_hf_model("qwen3_moe", tmp_path, mlp_only_layers=[])
    ckpt = resolve_target(tmp_path)
    mesh = make_mesh("data=4,tensor=2")
    w = load_target(ckpt, mesh, jnp.float32)
    with use_mesh(mesh):
        hlo = jax.jit(lambda w, t: target.forward(w, ckpt.config, t).hidden_BxTxD).lower(
            w, jnp.zeros((4, 64), jnp.int32)).compile().as_text()
    ops = re.findall(r"= (\S+) (all-to-all|all-gather|all-reduce|reduce-scatter|"
                     r"collective-permute)(?:-start)?\(", hlo)
    assert ops and {op for _, op in ops} == {"all-reduce"}, ops
    assert {shape for shape, _ in ops} == {"f32[1,64,64]{2,1,0}"}, ops


@pytest.mark.parametrize("rows_impl", ["xla", "pallas"])
def test_a_verified_tree_matches_the_full_forward_along_each_path(tmp_path, rows_impl):
    """forward_rows verifying a draft tree (the engine's verify: node t's keys at slot n + t,
    its RoPE position n + depth, its block mask its ancestors) on gpt-oss, whose windows (8)
    are shorter than the prompt and the tree's depth: every node's hidden state equals the
    full forward of its own root-to-node path, so windows are measured in positions, not
    slots; through the XLA window and through the ragged kernel reading the cache in place
    (interpret mode here), with gpt-oss's sinks."""
    assets.tiny_hf_model("gpt_oss", tmp_path)
    ckpt = resolve_target(tmp_path)
    cfg = ckpt.config
    w = load_target(ckpt, make_mesh("data=1", jax.devices()[:1]), jnp.float32)
    rng = np.random.default_rng(3)
    prompt = rng.integers(0, cfg.vocab_size, 12).tolist()
    # four children of the root, then a chain of nine under the last: node 13 (depth 10, slot
    # n + 13) is 9 positions from its ancestor node 4 (depth 1, slot n + 4), outside the
    # window, but only 6 if a new key's slot were taken for its position
    parent = [0, 0, 0, 0, 0, 4, 5, 6, 7, 8, 9, 10, 11, 12]
    nodes = rng.integers(0, cfg.vocab_size, len(parent)).tolist()
    paths = []
    for t in range(len(parent)):
        path = [t]
        while path[-1]:
            path.append(parent[path[-1]])
        paths.append(path[::-1])
    depth = [len(p) - 1 for p in paths]
    ancestors = np.asarray([[u in p for u in range(len(parent))] for p in paths])
    layers = target.unstack(w, cfg)
    cache = row_cache.RowCache.zeros(cfg, 1, 32, jnp.float32)

    @functools.partial(jax.jit, static_argnums=5)
    def rows(tokens, positions, cache, prefix, block, prefill):
        out, cache = row_cache.forward_rows(layers, cfg, tokens, positions, cache, prefix_B=prefix,
                                         block_mask_BxTxT=block, prefill=prefill, window=32,
                                         rows_impl=rows_impl)
        return out.hidden_BxTxD, cache

    _, cache = rows(jnp.asarray([prompt]), jnp.arange(12)[None], cache, jnp.asarray([0]), None,
                    True)
    got, _ = rows(jnp.asarray([nodes]), 12 + jnp.asarray([depth]), cache, jnp.asarray([12]),
                  jnp.asarray(ancestors)[None], False)
    # every path's full forward in one batch (one program, not one per path length): a row
    # padded after its path, which a causal forward never reads back
    seqs = [prompt + [nodes[u] for u in path] for path in paths]
    longest = max(map(len, seqs))
    full = np.asarray(jax.jit(lambda t: target.forward(w, cfg, t).hidden_BxTxD)(
        jnp.asarray([s + [0] * (longest - len(s)) for s in seqs])))
    for t, s in enumerate(seqs):
        assert_close(got[0, t], full[t, len(s) - 1], f"tree node {t} (depth {depth[t]})")
