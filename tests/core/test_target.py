"""Parity of the JAX target forward with transformers' PyTorch forward (fp32).

Tolerance: fp32 on both sides, same weights; the two implementations sum in different orders
(XLA vs. ATen matmuls, fused vs. eager softmax), so values agree to a relative error of about
1e-5 of the tensor's scale. We hold max |jax - torch| <= 2e-4 * max |torch| for logits and
every captured hidden state; a wrong rope, norm, bias, layout or layer index misses by orders
of magnitude more.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from eagle3kit.core import target
from eagle3kit.core.sharding import make_mesh
from eagle3kit.decode import row_cache
from eagle3kit.errors import InputError, UserError
from eagle3kit.io import safetensors as st
from eagle3kit.io.hf import load_target, resolve_target
from tests import assets

RTOL = 2e-4


def assert_close(actual, expected, what):
    actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    assert actual.shape == expected.shape, what
    scale = np.abs(expected).max()
    err = np.abs(actual - expected).max()
    assert err <= RTOL * scale, f"{what}: max error {err:.3g} vs scale {scale:.3g}"


def torch_reference(model, tokens: np.ndarray, aux_ids):
    with torch.no_grad():
        out = model(torch.tensor(tokens), output_hidden_states=True)
    return out.logits.numpy(), [out.hidden_states[i].numpy() for i in aux_ids]


def jax_forward(ckpt, mesh, tokens, dtype=jnp.float32, unstacked=False):
    """Logits and captured states; `unstacked`: through per-layer weights, "trainer" (split)
    or "decoder" (q|k|v and gate|up fused; True too)."""
    w = load_target(ckpt, mesh, dtype)
    cfg = ckpt.config
    if unstacked:
        w = target.unstack_in_place(w, cfg, fuse=unstacked != "trainer")

    @jax.jit
    def run(w, tokens):
        out = target.forward(w, cfg, tokens)
        return target.logits(w, out.hidden_BxTxD), out.aux_BxTxA

    logits, aux = run(w, jnp.asarray(tokens))
    d = cfg.hidden_size
    aux = np.asarray(aux)
    return np.asarray(logits), [aux[..., j * d:(j + 1) * d] for j in range(aux.shape[-1] // d)]


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("mesh_spec", ["data=1,tensor=1", "data=4,tensor=2"])
def test_tiny_parity(family, mesh_spec, tmp_path):
    model = assets.tiny_hf_model(family, tmp_path)
    ckpt = resolve_target(tmp_path)
    assert ckpt.config.family == family
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, ckpt.config.vocab_size, size=(4, 70))
    aux_ids = ckpt.config.default_aux_layer_ids()
    ref_logits, ref_aux = torch_reference(model, tokens, aux_ids)
    devices = jax.devices()[:1] if mesh_spec.startswith("data=1") else jax.devices()
    mesh = make_mesh(mesh_spec, devices)
    for unstacked in (False, "trainer", "decoder"):  # the scanned stack, per-layer weights
        logits, aux = jax_forward(ckpt, mesh, tokens, unstacked=unstacked)
        assert_close(logits, ref_logits, f"{family} logits")
        for i, (a, r) in enumerate(zip(aux, ref_aux, strict=True)):
            assert_close(a, r, f"{family} hidden_states[{aux_ids[i]}] (unstacked={unstacked})")


def test_weights_really_sharded(tmp_path):
    assets.tiny_hf_model("llama", tmp_path)
    ckpt = resolve_target(tmp_path)
    w = load_target(ckpt, make_mesh("data=4,tensor=2"), jnp.float32)
    q = w.layers.q  # L, D, N, H with N split over tensor
    assert q.sharding.spec[2] == "tensor"
    shard_shapes = {s.data.shape for s in q.addressable_shards}
    assert shard_shapes == {(6, 32, 2, 8)}
    # unstacked for decoding: each layer keeps its heads split, and the stack is freed
    stacked = jax.tree.leaves(w.layers) + jax.tree.leaves(w.mlp)
    layers = target.unstack_in_place(w, ckpt.config)
    assert all(a.is_deleted() for a in stacked)
    assert len(layers.layers) == len(layers.mlps) == ckpt.config.num_layers
    # q|k|v fused per kv head ([D, K, G+2, H]: 2 kv heads, 2 query heads each): still split
    # at the heads; gate|up [D, 2, F] still split along F
    for lw in layers.layers:
        assert lw.q is None and lw.qkv.shape == (32, 2, 4, 8)
        assert {s.data.shape for s in lw.qkv.addressable_shards} == {(32, 1, 4, 8)}
    assert layers.mlps[0].gate is None
    assert {s.data.shape for s in layers.mlps[0].gate_up.addressable_shards} == {
        (32, 2, ckpt.config.intermediate_size // 2)}


def test_indivisible_heads_is_a_clear_error(tmp_path):
    assets.tiny_hf_model("llama", tmp_path)  # 4 heads, 2 kv heads
    ckpt = resolve_target(tmp_path)
    mesh = make_mesh("data=2,tensor=4")
    with pytest.raises(UserError, match="kv_heads dimension 2 is not divisible by tensor=4"):
        load_target(ckpt, mesh, jnp.float32)


def test_cached_decoding_matches_full_forward(tmp_path):
    """forward_rows over a cache row (the engine's forward): a prefill, rejected tokens
    written and then overwritten, the rest read from the cache, equals the full forward."""
    assets.tiny_hf_model("qwen3", tmp_path)
    ckpt = resolve_target(tmp_path)
    cfg = ckpt.config
    w = load_target(ckpt, make_mesh("data=1", jax.devices()[:1]), jnp.float32)
    layers = target.unstack(w, cfg)
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, cfg.vocab_size, (1, 20)))
    full = jax.jit(lambda t: target.forward(w, cfg, t))(tokens)
    cache = row_cache.RowCache.zeros(cfg, 1, 32, jnp.float32)
    pos = jnp.arange(20)[None]
    step = jax.jit(lambda t, p, c, prefill: row_cache.forward_rows(
        layers, cfg, t, p, c, prefill=prefill, window=32,
        aux_layer_ids=cfg.default_aux_layer_ids()), static_argnums=3)
    out1, cache = step(tokens[:, :12], pos[:, :12], cache, True)
    # garbage from "rejected" tokens at 12..19 must be ignored and overwritten (as many as
    # the step after them: one program for both)
    _, cache = step(tokens[:, :8] + 1, pos[:, 12:], cache, False)
    out2, cache = step(tokens[:, 12:], pos[:, 12:], cache, False)
    hidden = np.concatenate([out1.hidden_BxTxD, out2.hidden_BxTxD], axis=1)
    aux = np.concatenate([out1.aux_BxTxA, out2.aux_BxTxA], axis=1)
    assert_close(hidden, full.hidden_BxTxD, "cached hidden")
    assert_close(aux, full.aux_BxTxA, "cached aux")


def test_padding_of_ragged_rows_writes_nowhere(tmp_path):
    """Prefill pieces of several rows at once (`rows_B`, the engine's prefill): a row's piece
    padded past the cache's last slot, and a padding row with the out-of-range index C
    (no request), must write nothing. Were their keys clipped into the last slot or the
    last row, they would land on real keys and change what the real tokens read: every
    real token's output must stay the full forward's of its own sequence."""
    assets.tiny_hf_model("llama", tmp_path)
    ckpt = resolve_target(tmp_path)
    cfg = ckpt.config
    w = load_target(ckpt, make_mesh("data=1", jax.devices()[:1]), jnp.float32)
    layers = target.unstack(w, cfg)
    rng = np.random.default_rng(3)
    seqs = [rng.integers(1, cfg.vocab_size, n) for n in (20, 14)]  # cache rows 0 and 2
    s, t, c = 20, 8, 3  # slots per row, piece length, cache rows
    step = jax.jit(lambda tok, pos, rows, cache, prefill: row_cache.forward_rows(
        layers, cfg, tok, pos, cache, rows_B=rows, prefill=prefill,
        window=0 if prefill else s), static_argnums=4)
    cache = row_cache.RowCache.zeros(cfg, c, s, jnp.float32)
    first = np.zeros((2, 16), np.int32)
    first[0], first[1, :10] = seqs[0][:16], seqs[1][:10]  # row 2: a 10-token piece, padded
    out1, cache = step(jnp.asarray(first), jnp.arange(16)[None].repeat(2, 0),
                       jnp.asarray([0, 2]), cache, True)
    # the second pieces: row 0's 4 last tokens at slots 16..19, padded to 8 (slots 20..23:
    # past the end), row 2's 4 at slots 10..13, and a padding row (index C) at slots 0..7
    piece = np.zeros((3, t), np.int32)
    piece[0, :4], piece[1, :4] = seqs[0][16:], seqs[1][10:]
    piece[2] = rng.integers(1, cfg.vocab_size, t)
    pos = np.asarray([16, 10, 0])[:, None] + np.arange(t)[None]
    out2, cache = step(jnp.asarray(piece), jnp.asarray(pos), jnp.asarray([0, 2, c]), cache,
                       False)
    both = np.zeros((2, 20), np.int32)  # row 2's sequence padded after its end (causal)
    both[0], both[1, :14] = seqs
    full = jax.jit(lambda t: target.forward(w, cfg, t).hidden_BxTxD)(jnp.asarray(both))
    for b, (seq, cut) in enumerate(zip(seqs, (16, 10), strict=True)):
        got = np.concatenate([out1.hidden_BxTxD[b, :cut], out2.hidden_BxTxD[b, :len(seq) - cut]])
        assert_close(got, full[b, :len(seq)], f"row {(0, 2)[b]}: a real token read a padding key")
    assert not np.asarray(cache.k[0][1]).any(), "row 1 (no request) was written"


def test_steps_of_every_row_slice_the_cache_window_not_gather_it(tmp_path):
    """A decode or verify step (every cache row, in order) reads each layer's window with a
    slice; only a subset of rows (a prefill piece) gathers it. On GPUs the gathered window
    halved the engine's decode speed (XLA copies it several times slower than a slice)."""
    assets.tiny_hf_model("llama", tmp_path)
    ckpt = resolve_target(tmp_path)
    cfg = ckpt.config
    layers = target.unstack(load_target(ckpt, make_mesh("data=1", jax.devices()[:1]),
                                        jnp.float32), cfg)
    c, s = 4, 64
    cache = row_cache.RowCache.zeros(cfg, c, s, jnp.float32)
    # a gather from the cache or from a window of it: [C, any slots, K, H]
    reads_cache = re.compile(rf"gather.*\(tensor<{c}x\d+x{cfg.num_kv_heads}x{cfg.head_dim}xf32>")

    def cache_gathers(t: int, rows) -> int:
        tokens = jnp.zeros((len(rows) if rows is not None else c, t), jnp.int32)
        positions = 5 + tokens + jnp.arange(t)
        text = jax.jit(lambda tok, pos, cache: row_cache.forward_rows(
            layers, cfg, tok, pos, cache, rows_B=rows, window=32)).lower(
            tokens, positions, cache).as_text()
        return len(reads_cache.findall(text))

    assert cache_gathers(1, None) == 0  # decode
    assert cache_gathers(4, None) == 0  # verify
    assert cache_gathers(4, jnp.asarray([2, 0])) == 2 * cfg.num_layers  # keys and values


def test_rows_over_data_devices_step_without_talking_to_each_other(tmp_path):
    """Decode and verify steps with the rows split over data=4 write each row's new keys on
    the device that holds the row: the compiled step has no collective. (An index scatter
    into the sharded cache was partitioned by all-gathering every row's new keys, values
    and slots to every device, three collectives per layer and step.)"""
    from jax.sharding import NamedSharding, PartitionSpec

    from eagle3kit.core.sharding import use_mesh

    assets.tiny_hf_model("llama", tmp_path)
    ckpt = resolve_target(tmp_path)
    cfg = ckpt.config
    mesh = make_mesh("data=4,tensor=1", jax.devices()[:4])
    layers = target.unstack(load_target(ckpt, mesh, jnp.float32), cfg)
    rows = NamedSharding(mesh, PartitionSpec("data"))
    c, s = 8, 64
    cache = jax.device_put(row_cache.RowCache.zeros(cfg, c, s, jnp.float32), rows)
    collective = re.compile(r"all-gather|all-reduce|all-to-all|collective-permute")
    for t in (1, 4):  # decode, verify
        tokens = jax.device_put(jnp.zeros((c, t), jnp.int32), rows)
        positions = jax.device_put(5 + jnp.zeros((c, t), jnp.int32) + jnp.arange(t), rows)
        with use_mesh(mesh):
            text = jax.jit(lambda tok, pos, cache: row_cache.forward_rows(
                layers, cfg, tok, pos, cache, window=32)).lower(
                tokens, positions, cache).compile().as_text()
        assert not collective.findall(text), f"T={t}: {sorted(set(collective.findall(text)))}"


def test_packed_segments_do_not_attend_across(tmp_path):
    assets.tiny_hf_model("llama", tmp_path)
    ckpt = resolve_target(tmp_path)
    cfg = ckpt.config
    w = load_target(ckpt, make_mesh("data=1", jax.devices()[:1]), jnp.float32)
    rng = np.random.default_rng(2)
    a, b = rng.integers(0, 96, (1, 10)), rng.integers(0, 96, (1, 7))
    packed = jnp.asarray(np.concatenate([a, b, np.zeros((1, 3), int)], axis=1))
    seg = jnp.asarray([[1] * 10 + [2] * 7 + [0] * 3])
    pos = jnp.asarray([list(range(10)) + list(range(7)) + [0] * 3])
    out = target.forward(w, cfg, packed, seg, pos)
    alone = target.forward(w, cfg, jnp.asarray(b))
    assert_close(out.hidden_BxTxD[:, 10:17], alone.hidden_BxTxD, "second packed document")


@pytest.mark.slow
@pytest.mark.parametrize("mesh_spec", ["data=1,tensor=1", "data=2,tensor=3"])
def test_smollm2_parity(mesh_spec, smollm2_torch):
    """The real SmolLM2-135M-Instruct: JAX (from the GGUF) vs transformers (same GGUF)."""
    model = smollm2_torch
    ckpt = resolve_target(assets.smollm2_gguf())
    cfg = ckpt.config
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads) == (30, 576, 9, 3)
    assert cfg.tie_word_embeddings and cfg.default_aux_layer_ids() == (2, 15, 27)
    tokens = np.random.default_rng(3).integers(0, cfg.vocab_size, (2, 48))
    ref_logits, ref_aux = torch_reference(model, tokens, cfg.default_aux_layer_ids())
    devices = jax.devices()[:1] if mesh_spec.startswith("data=1") else jax.devices()[:6]
    logits, aux = jax_forward(ckpt, make_mesh(mesh_spec, devices), tokens,
                              unstacked="trainer" if mesh_spec.startswith("data=1") else False)
    assert_close(logits, ref_logits, "SmolLM2 logits")
    for a, r in zip(aux, ref_aux, strict=True):
        assert_close(a, r, "SmolLM2 hidden state")


@pytest.mark.slow
def test_smollm2_gguf_equals_safetensors(smollm2_torch, tmp_path):
    """The GGUF and a safetensors export of the same weights give identical outputs."""
    model = smollm2_torch
    model.config.quantization_config = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.hf_quantizer = None
    model.save_pretrained(tmp_path, safe_serialization=True)
    gguf = resolve_target(assets.smollm2_gguf())
    directory = resolve_target(tmp_path)
    assert directory.config.num_layers == gguf.config.num_layers
    tokens = np.random.default_rng(4).integers(0, gguf.config.vocab_size, (1, 32))
    mesh = make_mesh("data=1", jax.devices()[:1])
    a_logits, a_aux = jax_forward(gguf, mesh, tokens)
    b_logits, b_aux = jax_forward(directory, mesh, tokens)
    np.testing.assert_array_equal(a_logits, b_logits)
    for a, b in zip(a_aux, b_aux, strict=True):
        np.testing.assert_array_equal(a, b)


def test_bad_checkpoints(tmp_path):
    with pytest.raises(InputError, match="no such checkpoint"):
        resolve_target(tmp_path / "nope")
    (tmp_path / "weights.bin").write_bytes(b"x")
    with pytest.raises(InputError, match="unsupported checkpoint file"):
        resolve_target(tmp_path / "weights.bin")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(InputError, match="no config.json"):
        resolve_target(empty)
    model_dir = tmp_path / "m"
    assets.tiny_hf_model("llama", model_dir)
    cfg = assets.read_json(model_dir / "config.json")
    (model_dir / "config.json").write_text(
        __import__("json").dumps({**cfg, "model_type": "gpt_neox"}))
    with pytest.raises(InputError, match="unsupported architecture"):
        resolve_target(model_dir)
    (model_dir / "config.json").write_text(
        __import__("json").dumps({**cfg, "hidden_size": 48}))
    with pytest.raises(InputError, match="does not match the config"):
        load_target(resolve_target(model_dir), make_mesh("data=1", jax.devices()[:1]))
    (tmp_path / "bad.gguf").write_bytes(b"GGUF" + b"\0" * 20)
    with pytest.raises(InputError, match="bad.gguf"):
        resolve_target(tmp_path / "bad.gguf")


def test_sharded_index_checkpoint(tmp_path):
    """A checkpoint split over files with model.safetensors.index.json loads the same."""
    assets.tiny_hf_model("qwen2", tmp_path / "one")
    tensors, _ = st.load(tmp_path / "one" / "model.safetensors")
    split = tmp_path / "two"
    split.mkdir()
    (split / "config.json").write_text((tmp_path / "one" / "config.json").read_text())
    names = sorted(tensors)
    halves = {"model-00001-of-00002.safetensors": names[: len(names) // 2],
              "model-00002-of-00002.safetensors": names[len(names) // 2:]}
    weight_map = {}
    for fname, part in halves.items():
        st.save(split / fname, {n: tensors[n] for n in part})
        weight_map.update({n: fname for n in part})
    (split / "model.safetensors.index.json").write_text(
        __import__("json").dumps({"weight_map": weight_map}))
    mesh = make_mesh("data=1", jax.devices()[:1])
    tokens = np.arange(12)[None] % 96
    a, _ = jax_forward(resolve_target(tmp_path / "one"), mesh, tokens)
    b, _ = jax_forward(resolve_target(split), mesh, tokens)
    np.testing.assert_array_equal(a, b)
