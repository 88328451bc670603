"""decode/skinny_matmul: the few-row matmul kernel (Pallas' interpreter on CPU) against a float64
product, and a decode step through it (`forward_rows(matmul_impl="pallas")`) against the same
step through XLA's matmuls. fp32 throughout: the two differ only in summation order."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from eagle3kit.core import target
from eagle3kit.core.config import TargetConfig
from eagle3kit.core.sharding import init_weights
from eagle3kit.decode import row_cache, skinny_matmul
from eagle3kit.decode.skinny_matmul import MAX_ROWS, MIN_ROWS, SkinnyBlocks, fits, pays
from tests import triton_lowering

TOL = dict(rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("m, k, n, blocks", [
    (1, 256, 128, SkinnyBlocks(interpret=True)),  # one row, padded to the 16-row tile
    (5, 512, 192, SkinnyBlocks(block_k=128, interpret=True)),  # K split among programs
    (16, 384, 64, SkinnyBlocks(block_n=64, block_k=64, split=3, interpret=True)),
    (33, 128, 256, SkinnyBlocks(block_n=128, block_k=64, split=1, interpret=True)),
])
def test_the_kernel_equals_a_float64_product(m, k, n, blocks):
    rng = np.random.default_rng(m)
    x, w = rng.normal(size=(m, k)), rng.normal(size=(k, n))
    out = skinny_matmul.skinny_matmul(jnp.asarray(x, jnp.float32), jnp.asarray(w, jnp.float32), blocks)
    assert out.shape == (m, n) and out.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(out), x @ w, rtol=2e-5, atol=2e-4)


def test_the_kernel_takes_a_few_rows_of_large_weights_its_tiles_divide():
    blocks = SkinnyBlocks()
    assert fits(4096, 6144, blocks) and fits(14336, 4096, blocks)
    assert not fits(576, 100, blocks) and not fits(100, 128, blocks)
    o_8b, down_smollm2 = (jax.ShapeDtypeStruct(s, jnp.bfloat16) for s in ((4096, 4096),
                                                                          (1536, 576)))
    assert pays(MIN_ROWS, o_8b, blocks) and pays(MAX_ROWS, o_8b, blocks)
    assert not pays(MAX_ROWS + 1, o_8b, blocks)  # prefill, big batches: XLA
    assert not pays(MIN_ROWS - 1, o_8b, blocks)  # a few rows: XLA's as fast
    assert not pays(32, down_smollm2, blocks)  # a small model's weights: XLA


TINY = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 256,
        "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
        "rms_norm_eps": 1e-6, "rope_theta": 10000, "max_position_embeddings": 256,
        "tie_word_embeddings": True}


def test_a_decode_step_through_the_kernel_equals_the_full_forward(monkeypatch):
    """q|k|v (fused, [128, 2 x 4 x 32]), o_proj and down all divide the kernel's 64 x 64
    tiles, so each goes through it (here at any size and row count). A prefill (39 rows: the kernel too) then two
    single-token steps of three rows at different lengths, through the kernel and through
    XLA's matmuls, each against the stacked target's full forward of each row's sequence."""
    monkeypatch.setattr(skinny_matmul, "MIN_BYTES", 0)
    monkeypatch.setattr(skinny_matmul, "MIN_ROWS", 1)
    cfg = TargetConfig.from_hf_config(TINY)
    w = init_weights(target.TargetWeights.abstract(cfg, jnp.float32), jax.random.key(0))
    layers = target.unstack(w, cfg)
    rng = np.random.default_rng(0)
    lens = np.array([9, 4, 13])
    prompt = rng.integers(0, 256, (3, 13))
    tokens = rng.integers(0, 256, (2, 3, 1))
    for impl in ("xla", "pallas"):
        step = jax.jit(lambda t, p, c, prefix, prefill, impl=impl: row_cache.forward_rows(
            layers, cfg, t, p, c, prefix_B=prefix, prefill=prefill, window=32,
            matmul_impl=impl), static_argnums=4)
        cache = row_cache.RowCache.zeros(cfg, 3, 32, jnp.float32)
        _, cache = step(jnp.asarray(prompt), jnp.broadcast_to(jnp.arange(13), (3, 13)), cache,
                        jnp.zeros(3, jnp.int32), True)
        jaxpr = str(jax.make_jaxpr(step, static_argnums=4)(
            jnp.asarray(tokens[0]), jnp.asarray(lens)[:, None], cache, jnp.asarray(lens), False))
        # q|k|v, o_proj and down of both layers through the kernel, nothing else
        assert jaxpr.count("name=skinny_matmul") == (6 if impl == "pallas" else 0), impl
        hidden = []
        for i, token in enumerate(tokens):
            pos = jnp.asarray(lens + i)[:, None]
            out, cache = step(jnp.asarray(token), pos, cache, jnp.asarray(lens + i), False)
            hidden.append(np.asarray(out.hidden_BxTxD))
        for b, n in enumerate(lens):
            seq = np.concatenate([prompt[b, :n], tokens[:, b, 0]])[None]
            full = target.forward(w, cfg, jnp.asarray(seq), aux_layer_ids=()).hidden_BxTxD[0, n:]
            np.testing.assert_allclose(np.concatenate(hidden, axis=1)[b], full, **TOL,
                                       err_msg=f"{impl}, row {b}")


@pytest.mark.parametrize("m, k, split", [(16, 512, 1), (40, 512, 4), (64, 14336, 0)])
def test_the_kernel_lowers_to_a_valid_triton_module(monkeypatch, m, k, split):
    """The engine's tiles lowered for the GPU (no GPU needed), bf16 as decoding runs it, give
    a Triton module that verifies: interpret mode would not see a dot or a loop Triton
    refuses, nor rows padded to no power of two (40 rows once padded to 48, which only the
    GPU's lowering refused). 14336: an 8B's down projection, split in shares of 3,584."""
    verified = triton_lowering.verified(monkeypatch)
    blocks = SkinnyBlocks(split=split)  # the engine's tiles, not interpreted
    x = jax.ShapeDtypeStruct((m, k), jnp.bfloat16)
    w = jax.ShapeDtypeStruct((k, 256), jnp.bfloat16)
    jax.jit(lambda x, w: skinny_matmul.skinny_matmul(x, w, blocks)).trace(x, w).lower(
        lowering_platforms=("cuda",))
    assert verified == [True]
