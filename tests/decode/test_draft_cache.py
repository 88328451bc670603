"""The cached draft chain computes exactly what the trainer trains (core/ttt.py).

With every earlier draft token right, the inputs of drafting step k at column c are the
teacher-forced ones, so its logits must equal the TTT rollout's step-k logits at column c.
The rollout here is `core.ttt`'s own step function, looped as `ttt.rollout` loops it. Two
decoding rounds run against one cache, with garbage in the padded prefill and in the
rejected columns, so stale entries are proven unread and overwritten.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from eagle3kit.core import draft, target, ttt
from eagle3kit.decode import draft_cache

K = 4
T = 24


@pytest.fixture(scope="module", params=["eagle3", "eagle3.1"])
def setup(tiny, request):
    """The tiny draft, and the same draft as EAGLE-3.1 (perturbed fc norms, post-norm state
    carried): the decoder and the trainer run one draft step, whatever the architecture."""
    tcfg, tw, dcfg, w, vocab, _ = tiny
    if request.param != "eagle3":
        dcfg = dcfg.with_arch(request.param)
        norms = 1 + 0.3 * jax.random.normal(jax.random.key(3), draft.DraftWeights.abstract(
            dcfg).fc_norm.shape)
        w = dataclasses.replace(w, fc_norm=norms)
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 96, (1, T)), jnp.int32)
    return tcfg, tw, dcfg, w, vocab, tokens


@functools.partial(jax.jit, static_argnums=(0, 2))
def ttt_logits(tcfg, tw, dcfg, w, vocab, tokens) -> jax.Array:
    """[K, T, Vd] draft logits of every TTT step at every column, by the trainer's code."""
    ones = jnp.ones_like(tokens)
    batch = ttt.Batch(tokens, ones, ones, jnp.arange(T, dtype=jnp.int32)[None])
    sig = ttt.target_signals(tw, tcfg, dcfg, vocab, batch)
    valid = ttt.valid_masks(batch, K)
    hidden, keys, values, out = draft.fuse(w, dcfg, sig.aux_BxTxA), [], [], []
    for k in range(K):
        step = functools.partial(ttt._one_step, cfg=dcfg, k=k)
        hidden, key, value, _, _ = step(
            w, hidden, ttt._shift(sig.embeds_BxTxD, 1 + k), batch.positions + k, keys, values,
            batch.segment_ids, sig.probs_BxTxVd, sig.argmax_BxT, valid[k],
            sig.in_draft_BxT, vocab)
        keys.append(key)
        values.append(value)
        out.append(draft.head(w, dcfg, hidden)[0])
    return jnp.stack(out)


@functools.partial(jax.jit, static_argnums=1)
def chain_logits(tw, dcfg, w, tokens, h_1x1xD, column, cache):
    """Step-0 logits from `h`, then K-1 chain steps fed the true next tokens."""
    out = [draft.head(w, dcfg, h_1x1xD)[0, 0]]
    h = h_1x1xD
    for i in range(1, K):
        token = jax.lax.dynamic_slice_in_dim(tokens, column + 1 + i, 1, axis=1)
        logits, h, cache = draft_cache.chain_step(w, dcfg, tw, h, token, column + i, cache)
        out.append(logits[0, 0])
    return jnp.stack(out), cache


def test_two_decoding_rounds_equal_the_ttt_rollout(setup):
    tcfg, tw, dcfg, w, vocab, tokens = setup
    reference = np.asarray(ttt_logits(tcfg, tw, dcfg, w, vocab, tokens))
    extend = jax.jit(draft_cache.extend, static_argnums=1)
    aux = target.forward(tw, tcfg, tokens, aux_layer_ids=dcfg.aux_layer_ids).aux_BxTxA
    garbage = jax.random.normal(jax.random.key(7), aux.shape) * 3
    cache = draft_cache.DraftKV.zeros(dcfg, 1, 64, jnp.float32)

    # round 1: a prompt of 9 tokens padded to 16 (garbage states past it); column 8 drafts
    n, padded = 9, 16
    pad_aux = jnp.where(jnp.arange(T)[None, :, None] < n, aux, garbage)[:, :padded]
    h, cache = extend(w, dcfg, tw, pad_aux, tokens[:, 1:padded + 1], jnp.int32(0), cache)
    got, cache = chain_logits(tw, dcfg, w, tokens, h[:, n - 1:n], n - 1, cache)
    np.testing.assert_allclose(got, reference[:, n - 1], rtol=1e-4, atol=1e-4)

    # round 2: verify accepted a = 2 of K drafts; extend K+1 columns n..n+K, of which
    # n..n+2 are committed and the rest garbage, overwriting round 1's chain entries
    a = 2
    cols = slice(n, n + K + 1)
    ext_aux = jnp.where(jnp.arange(T)[None, :, None] <= n + a, aux, garbage)[:, cols]
    junk = jnp.full((1, K + 1), 5, jnp.int32)
    next_tokens = jnp.where(jnp.arange(K + 1)[None] <= a, tokens[:, n + 1:n + K + 2], junk)
    h, cache = extend(w, dcfg, tw, ext_aux, next_tokens, jnp.int32(n), cache)
    column = n + a
    got, cache = chain_logits(tw, dcfg, w, tokens, h[:, a:a + 1], column, cache)
    np.testing.assert_allclose(got, reference[:, column], rtol=1e-4, atol=1e-4)
    assert np.abs(reference[:, column] - reference[:, n - 1]).max() > 0.1  # columns differ


def test_extend_is_causal_within_a_call(setup):
    """Column j of one extend call never sees columns after it: its h is the same whether
    or not later columns are present."""
    tcfg, tw, dcfg, w, vocab, tokens = setup
    aux = target.forward(tw, tcfg, tokens, aux_layer_ids=dcfg.aux_layer_ids).aux_BxTxA
    cache = draft_cache.DraftKV.zeros(dcfg, 1, 32, jnp.float32)
    extend = jax.jit(draft_cache.extend, static_argnums=1)
    full, _ = extend(w, dcfg, tw, aux[:, :12], tokens[:, 1:13], jnp.int32(0), cache)
    part, _ = extend(w, dcfg, tw, aux[:, :7], tokens[:, 1:8], jnp.int32(0), cache)
    np.testing.assert_allclose(np.asarray(full[:, :7]), np.asarray(part), rtol=1e-5, atol=1e-5)
