"""The fused TTT attention kernel (Pallas, interpret mode on CPU) against plain formulas.

fp32 throughout, so kernel and reference differ only in summation order and in exp2/log2
against exp/log: observed under 2e-6 of the largest value; 2e-5 (relative and absolute, all
values of order 1..100) leaves room for other CPUs' rounding and is still 1e4 times smaller
than any of the errors a wrong mask, a missing term or a wrong scale makes (those are O(1)).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from eagle3kit.core import ttt
from eagle3kit.core.flash import FlashBlocks, flash_attention
from eagle3kit.core.layers import causal_mask
from eagle3kit.core.sharding import make_mesh, use_mesh

TOL = dict(rtol=2e-5, atol=2e-5)
B, T, N, KH, H = 2, 20, 4, 2, 16  # T = 20 is no multiple of the 8-row tiles: padding runs
BLOCKS = FlashBlocks(q=8, k=8, bwd_q=8, bwd_k=8, interpret=True)


@pytest.fixture(scope="module")
def inputs():
    """q, k, v (GQA: two query heads per kv head), packed segments with padding, and fixed
    random cotangents for out and lse."""
    rng = np.random.default_rng(0)
    seg = np.ones((B, T), np.int32)
    seg[0, 6:15], seg[0, 15:] = 2, 0
    f32 = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.float32)  # noqa: E731
    return dict(q=f32(B, T, N, H), k=f32(B, T, KH, H), v=f32(B, T, KH, H), seg=jnp.asarray(seg),
                d_out=f32(B, T, N, H), d_lse=f32(B, N, T))


def dense_attention(q, k, v, seg):
    """(out [B,T,N,H], lse [B,N,T]) from the whole [T, T] score matrix."""
    b, t, n, h = q.shape
    qg = q.reshape(b, t, k.shape[2], n // k.shape[2], h)
    s = jnp.einsum("btkgh,bskh->bkgts", qg, k) / np.sqrt(h)
    s = jnp.where(causal_mask(seg)[:, None, None], s, -1e30)
    out = jnp.einsum("bkgts,bskh->btkgh", jax.nn.softmax(s, axis=-1), v)
    return out.reshape(b, t, n, h), jax.nn.logsumexp(s, axis=-1).reshape(b, n, t)


def test_kernel_returns_out_and_lse_with_their_gradients(inputs):
    """Values of (out, lse) and the gradients w.r.t. q, k, v of a loss that reads both:
    the lse term checks that the backward pass takes the lse cotangent."""
    x = inputs

    def loss(f, q, k, v):
        out, lse = f(q, k, v, x["seg"])
        return jnp.sum(out * x["d_out"]) + jnp.sum(lse * x["d_lse"]), (out, lse)

    kernel = lambda *a: flash_attention(*a, blocks=BLOCKS)  # noqa: E731
    got = jax.jit(jax.value_and_grad(lambda *a: loss(kernel, *a), argnums=(0, 1, 2),
                                     has_aux=True))(x["q"], x["k"], x["v"])
    want = jax.jit(jax.value_and_grad(lambda *a: loss(dense_attention, *a), argnums=(0, 1, 2),
                                      has_aux=True))(x["q"], x["k"], x["v"])
    names = ["loss", "out", "lse", "dq", "dk", "dv"]
    for name, a, b in zip(names, jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), **TOL, err_msg=name)


def test_fused_ttt_attention_equals_the_xla_blocks(inputs):
    """Step 0 plus two diagonal steps: the kernel merged by log-sum-exp against the XLA
    path (one block of rows: the blocking itself is checked against the dense formula in
    test_ttt.py), values and gradients w.r.t. q and every step's keys and values. The
    kernel runs under a two-device mesh: each device on its own row (`shard_map`)."""
    x = inputs
    rng = np.random.default_rng(1)
    keys = [x["k"], *(jnp.asarray(rng.standard_normal((B, T, KH, H)), jnp.float32)
                      for _ in range(2))]
    values = [x["v"], *(jnp.asarray(rng.standard_normal((B, T, KH, H)), jnp.float32)
                        for _ in range(2))]

    def loss(impl, q, keys, values):
        return jnp.sum(ttt._ttt_attend(q, keys, values, x["seg"], block=T, impl=impl)
                       * x["d_out"])

    def grad(impl):
        with use_mesh(make_mesh("data=2", jax.devices()[:2])):
            return jax.jit(jax.value_and_grad(lambda *a: loss(impl, *a), argnums=(0, 1, 2)))(
                x["q"], keys, values)

    for a, b in zip(jax.tree.leaves(grad("pallas")), jax.tree.leaves(grad("xla")), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), **TOL)


@pytest.mark.skipif(jax.default_backend() != "gpu", reason="the Triton kernel runs on GPUs")
def test_kernel_on_gpu_in_bf16_matches_the_xla_path():
    """One Llama-8B-shaped draft block (32 heads, 8 kv heads, H = 128, T = 2048, packed)
    in bf16 against the XLA path in fp32, values and gradients: relative error under 1e-2
    (bf16 rounding of the inputs and of P). Run: JAX_PLATFORMS=cuda pytest -k gpu"""
    rng = np.random.default_rng(5)
    b, t, n, kh, h = 1, 2048, 32, 8, 128
    seg = np.ones((b, t), np.int32)
    seg[0, 700:1900], seg[0, 1900:] = 2, 0
    seg = jnp.asarray(seg)
    q, k1, k2, v1, v2, ct = (jnp.asarray(rng.standard_normal(s), jnp.float32) for s in
                             [(b, t, n, h), *[(b, t, kh, h)] * 4, (b, t, n, h)])

    def run(impl, dtype):
        args = [x.astype(dtype) for x in (q, k1, k2, v1, v2)]
        f = lambda q, k1, k2, v1, v2: ttt._ttt_attend(q, [k1, k2], [v1, v2], seg,  # noqa: E731
                                                      impl=impl)
        out, vjp = jax.vjp(f, *args)
        return [np.asarray(x, np.float32) for x in (out, *vjp(ct.astype(dtype)))]

    for x, y in zip(run("pallas", jnp.bfloat16), run("xla", jnp.float32), strict=True):
        assert np.linalg.norm(x - y) / np.linalg.norm(y) < 1e-2
