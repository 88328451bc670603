"""The jitted TTT rollout against a plain, unbatched numpy reference, and causality.

The reference takes nothing from `ttt`: the target's signals (embeddings, captured states,
the draft-vocab distribution, argmax, in-draft) come from transformers' torch forward of
each document on its own, and the rollout is a plain loop in float64.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from eagle3kit.core import target, ttt
from eagle3kit.core.config import DraftConfig
from eagle3kit.core.draft import DraftWeights
from eagle3kit.core.draft import arrays as draft_arrays
from eagle3kit.core.layers import attend, causal_mask
from eagle3kit.core.sharding import init_weights, make_mesh
from eagle3kit.core.vocab import VocabMap
from eagle3kit.core.vocab_arrays import VocabArrays
from eagle3kit.io.hf import load_target, resolve_target
from tests import assets
from tests.core import test_losses

K = 3
# the target's signals of a batch, one program per batch shape for the module (target and
# draft configs static), not one per test nor a primitive at a time
signals = jax.jit(ttt.target_signals, static_argnums=(1, 2))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(checkpoint directory, the torch model saved there)."""
    path = tmp_path_factory.mktemp("tiny")
    return path, assets.tiny_hf_model("llama", path)


@pytest.fixture(scope="module")
def setup(tiny):
    path, _ = tiny
    ckpt = resolve_target(path)
    tcfg = ckpt.config
    tw = load_target(ckpt, make_mesh("data=1", jax.devices()[:1]), jnp.float32)
    dcfg = DraftConfig.for_target(tcfg, draft_vocab_size=64)
    w = init_weights(DraftWeights.abstract(dcfg), jax.random.key(0))
    rng = np.random.default_rng(0)
    for name in ("hidden_norm", "input_norm", "post_attn_norm", "final_norm"):
        setattr(w, name, jnp.asarray(1 + 0.2 * rng.standard_normal(dcfg.hidden_size),
                                     jnp.float32))
    # odd ids only and a few more: some target argmaxes fall outside the draft vocab
    vocab = VocabMap.from_ids(np.r_[np.arange(1, 96, 2), np.arange(0, 32, 2)], 96)
    return tcfg, tw, dcfg, w, vocab


def packed_batch(rng, t=24):
    """Two rows: two documents + padding, and one document filling the row."""
    tokens = rng.integers(0, 96, (2, t)).astype(np.int32)
    seg = np.zeros((2, t), np.int32)
    pos = np.zeros((2, t), np.int32)
    seg[0, :9], pos[0, :9] = 1, np.arange(9)
    seg[0, 9:20], pos[0, 9:20] = 2, np.arange(11)
    seg[1], pos[1] = 1, np.arange(t)
    mask = (rng.random((2, t)) < 0.7).astype(np.int32) * (seg > 0)
    return ttt.Batch(*(jnp.asarray(x) for x in (tokens, mask, seg, pos)))


# ---- the plain reference ------------------------------------------------------------------

def torch_signals(model, batch, vocab: VocabMap, aux_ids):
    """The target's signals from transformers, one document at a time (float64 numpy):
    softmax over the draft-vocab logits (renormalised there), argmax over the whole vocab,
    in_draft = t2d[argmax]. Padding columns stay zero."""
    tokens, seg = np.asarray(batch.tokens), np.asarray(batch.segment_ids)
    b_rows, t_len = tokens.shape
    d = model.config.hidden_size
    logits = np.zeros((b_rows, t_len, model.config.vocab_size))
    aux = np.zeros((b_rows, t_len, len(aux_ids) * d))
    for b in range(b_rows):
        for s in set(seg[b].tolist()) - {0}:
            cols = np.flatnonzero(seg[b] == s)
            with torch.no_grad():
                out = model(torch.tensor(tokens[b, cols])[None], output_hidden_states=True)
            logits[b, cols] = out.logits[0].double().numpy()
            aux[b, cols] = np.concatenate([out.hidden_states[i][0].double().numpy()
                                           for i in aux_ids], -1)
    draft_logits = logits[..., vocab.used_ids]
    e = np.exp(draft_logits - draft_logits.max(-1, keepdims=True))
    argmax = logits.argmax(-1)
    top2 = np.sort(logits, -1)[..., -2:]
    return dict(
        embeds_BxTxD=model.model.embed_tokens.weight.double().detach().numpy()[tokens],
        aux_BxTxA=aux, probs_BxTxVd=e / e.sum(-1, keepdims=True), argmax_BxT=argmax,
        in_draft_BxT=vocab.t2d[argmax], top2_gap_BxT=top2[..., 1] - top2[..., 0])


def rms(x, w, eps):
    return w * (x / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps))


def rope_vec(x, pos, inv_freq):  # x [n, h]
    ang = pos * inv_freq
    ang = np.concatenate([ang, ang])
    half = x.shape[-1] // 2
    rot = np.concatenate([-x[..., half:], x[..., :half]], -1)
    return x * np.cos(ang) + rot * np.sin(ang)


def softmax(x):
    e = np.exp(x - x.max())
    return e / e.sum()


def reference_loss(w, cfg: DraftConfig, sig, batch, used_ids, decay=0.8, record=None):
    """The soft cross-entropy loss with geometric weights, and the counts; `record` (a list)
    receives (k, b, t, logits, p, in_draft, right) of every valid position."""
    w = {k: np.asarray(v, np.float64) for k, v in draft_arrays(w).items()}
    eps, nh, kvh, hd = cfg.rms_norm_eps, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    inv = cfg.rope.inv_freq(hd).astype(np.float64)
    tokens, lmask, seg, pos = (np.asarray(x) for x in (batch.tokens, batch.loss_mask,
                                                       batch.segment_ids, batch.positions))
    embeds, aux = sig["embeds_BxTxD"], sig["aux_BxTxA"]
    probs, amax, in_draft = sig["probs_BxTxVd"], sig["argmax_BxT"], sig["in_draft_BxT"]
    b_rows, t_len = tokens.shape
    ce_sum, valid_sum = np.zeros(K), np.zeros(K)
    correct, cond_total, cond_correct = np.zeros(K), np.zeros(K), np.zeros(K)
    features = []  # (final-normed h, the target's argmax) of every valid position
    for b in range(b_rows):
        all_right = np.ones(t_len, bool)  # steps 0..k-1 all right at column t
        hidden = [aux[b, t] @ w["fc"] for t in range(t_len)]
        keys, vals = [], []
        for k in range(K):
            qs, ks, vs, res = [], [], [], []
            for t in range(t_len):
                j = t + 1 + k
                e = embeds[b, j] if j < t_len else np.zeros_like(embeds[b, 0])
                x = np.concatenate([rms(e, w["input_norm"], eps),
                                    rms(hidden[t], w["hidden_norm"], eps)])
                qs.append(rope_vec(np.einsum("e,enh->nh", x, w["q"]), pos[b, t] + k, inv))
                ks.append(rope_vec(np.einsum("e,ekh->kh", x, w["k"]), pos[b, t] + k, inv))
                vs.append(np.einsum("e,ekh->kh", x, w["v"]))
                res.append(hidden[t])
            keys.append(ks)
            vals.append(vs)
            new_hidden = []
            for t in range(t_len):
                if seg[b, t] == 0:  # padding column: never read, never trained
                    new_hidden.append(np.zeros_like(hidden[t]))
                    continue
                visible = [s for s in range(t + 1) if seg[b, s] == seg[b, t]]
                out = np.zeros((nh, hd))
                for n in range(nh):
                    g = n // (nh // kvh)
                    cand = [(keys[0][s][g], vals[0][s][g]) for s in visible]
                    cand += [(keys[i][t][g], vals[i][t][g]) for i in range(1, k + 1)]
                    scores = np.array([qs[t][n] @ kk for kk, _ in cand]) / np.sqrt(hd)
                    p = softmax(scores)
                    out[n] = sum(pi * vv for pi, (_, vv) in zip(p, cand, strict=True))
                h = res[t] + np.einsum("nh,nhd->d", out, w["o"])
                m = rms(h, w["post_attn_norm"], eps)
                act = (m @ w["gate"]) / (1 + np.exp(-(m @ w["gate"]))) * (m @ w["up"])
                h = h + act @ w["down"]
                new_hidden.append(h)
                j = t + 1 + k
                valid = (t + k < t_len and lmask[b, t + k] > 0 and j < t_len
                         and seg[b, j] == seg[b, t])
                if not valid:
                    all_right[t] = False
                    continue
                features.append((rms(h, w["final_norm"], eps), amax[b, j]))
                logits = features[-1][0] @ w["lm_head"]
                logp = logits - logits.max() - np.log(np.exp(logits - logits.max()).sum())
                valid_sum[k] += 1
                if in_draft[b, j]:
                    ce_sum[k] += -(probs[b, j] * logp).sum()
                right = used_ids[np.argmax(logits)] == amax[b, j]
                if record is not None:
                    record.append((k, b, t, logits, probs[b, j], in_draft[b, j], right))
                correct[k] += right
                cond_total[k] += all_right[t]
                cond_correct[k] += all_right[t] and right
                all_right[t] &= right
            hidden = new_hidden
    loss = sum(decay ** k * ce_sum[k] / max(valid_sum[k], 1) for k in range(K))
    return loss, valid_sum, correct, cond_total, cond_correct, features


def test_target_signals_match_torch(setup, tiny):
    """fp32 JAX vs fp32 torch on the same weights: about 1e-6 relative (summation order);
    the probabilities are held to 1e-5 absolute, far below the ~1e-2 that a softmax over
    the whole vocab restricted to the draft ids (not renormalised) would be off by."""
    tcfg, tw, dcfg, _, vocab = setup
    batch = packed_batch(np.random.default_rng(1))
    sig = signals(tw, tcfg, dcfg, VocabArrays.from_map(vocab), batch)
    ref = torch_signals(tiny[1], batch, vocab, dcfg.aux_layer_ids)
    real = np.asarray(batch.segment_ids) > 0
    # argmax and in_draft compared exactly: no near-tie among the real columns
    assert ref["top2_gap_BxT"][real].min() > 1e-4
    np.testing.assert_array_equal(np.asarray(sig.argmax_BxT)[real], ref["argmax_BxT"][real])
    np.testing.assert_array_equal(np.asarray(sig.in_draft_BxT)[real], ref["in_draft_BxT"][real])
    assert 0 < ref["in_draft_BxT"][real].mean() < 1
    np.testing.assert_allclose(np.asarray(sig.probs_BxTxVd)[real], ref["probs_BxTxVd"][real],
                               atol=1e-5)
    for name in ("embeds_BxTxD", "aux_BxTxA"):
        got, want = np.asarray(getattr(sig, name))[real], ref[name][real]
        assert np.abs(got - want).max() <= 2e-5 * np.abs(want).max(), name


def fit_head(w, dcfg, sig, batch, vocab):
    """The draft with its lm_head fitted by least squares to the target's argmax at every
    step (the hidden states do not depend on the head), so that many draft tokens are right
    and the conditional counts of later steps are not all zero."""
    feats = reference_loss(w, dcfg, sig, batch, vocab.used_ids)[-1]
    x = np.stack([f for f, _ in feats])
    index = np.cumsum(vocab.t2d) - 1  # target id -> draft index
    y = np.zeros((len(feats), dcfg.draft_vocab_size))
    for i, (_, target_id) in enumerate(feats):
        if vocab.t2d[target_id]:
            y[i, index[target_id]] = 1.0
    head = np.linalg.lstsq(x, y, rcond=None)[0]
    return dataclasses.replace(w, lm_head=jnp.asarray(head, jnp.float32))


def test_rollout_matches_plain_reference(setup, tiny):
    tcfg, tw, dcfg, w, vocab = setup
    batch = packed_batch(np.random.default_rng(1))
    va = VocabArrays.from_map(vocab)
    cfg = ttt.TTTConfig(steps=K, compute_dtype=jnp.float32)
    sig = signals(tw, tcfg, dcfg, va, batch)
    ref = torch_signals(tiny[1], batch, vocab, dcfg.aux_layer_ids)
    assert not ref["in_draft_BxT"].all(), "some targets must be outside"
    w = fit_head(w, dcfg, ref, batch, vocab)
    denominators = ttt.valid_counts(batch, K)
    loss, counts = jax.jit(lambda w: ttt.rollout(w, dcfg, sig, batch, va, cfg, denominators))(w)
    ref_loss, ref_valid, ref_correct, ref_cond_total, ref_cond_correct, _ = reference_loss(
        w, dcfg, ref, batch, vocab.used_ids)
    np.testing.assert_array_equal(np.asarray(counts.total), ref_valid)
    np.testing.assert_array_equal(np.asarray(denominators), ref_valid)
    np.testing.assert_array_equal(np.asarray(counts.correct), ref_correct)
    np.testing.assert_array_equal(np.asarray(counts.cond_total), ref_cond_total)
    np.testing.assert_array_equal(np.asarray(counts.cond_correct), ref_cond_correct)
    np.testing.assert_allclose(float(loss), ref_loss, rtol=1e-5)
    assert ref_valid.min() > 10


def test_rollout_with_tv_and_verify_weights_matches_plain_reference(setup, tiny):
    """Another loss and the verification-aware weights through the whole rollout: the loss
    from the plain reference's logits with test_losses' numpy definitions, and the counts'
    CE still the soft cross-entropy (comparable between runs of different losses)."""
    tcfg, tw, dcfg, w, vocab = setup
    batch = packed_batch(np.random.default_rng(1))
    va = VocabArrays.from_map(vocab)
    cfg = ttt.TTTConfig(steps=K, compute_dtype=jnp.float32, loss="tv",
                        position_weights="verify")
    sig = signals(tw, tcfg, dcfg, va, batch)
    ref = torch_signals(tiny[1], batch, vocab, dcfg.aux_layer_ids)
    w = fit_head(w, dcfg, ref, batch, vocab)
    loss, counts = jax.jit(lambda w: ttt.rollout(w, dcfg, sig, batch, va, cfg,
                                                 ttt.valid_counts(batch, K)))(w)
    record = []
    reference_loss(w, dcfg, ref, batch, vocab.used_ids, record=record)
    shape = (K, *np.asarray(batch.tokens).shape)
    valid, right = np.zeros(shape, bool), np.zeros(shape, bool)
    tv, ce = np.zeros(shape), np.zeros(shape)
    for k, b, t, logits, p, in_draft, ok in record:
        valid[k, b, t], right[k, b, t] = True, ok
        if in_draft:
            tv[k, b, t] = test_losses.reference("tv", logits, p)
            ce[k, b, t] = test_losses.reference("kl", logits, p)
    n = valid.sum((1, 2))
    weights = test_losses.reference_weights("verify", 0.8, valid, right)
    want = sum((weights[k] * tv[k]).sum() / n[k] for k in range(K))
    geometric = sum(0.8 ** k * tv[k].sum() / n[k] for k in range(K))
    # the fitted draft is often right, so the weights moved: by 100x the tolerance below
    assert right.sum() > 20 and abs(want - geometric) > 1e-3 * want
    np.testing.assert_allclose(float(loss), want, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(counts.ce_sum), ce.sum((1, 2)), rtol=1e-5)


def test_causality(setup):
    """The loss over columns whose windows end before position c ignores every token after
    c, and its gradient w.r.t. the captured states after c is exactly zero."""
    tcfg, tw, dcfg, w, vocab = setup
    va = VocabArrays.from_map(vocab)
    cfg = ttt.TTTConfig(steps=K, compute_dtype=jnp.float32)
    batch = packed_batch(np.random.default_rng(2))
    c = 13
    # keep only loss positions t + k <= c - 1, i.e. windows ending at or before c
    cut = batch.loss_mask.at[:, c:].set(0)
    early = ttt.Batch(batch.tokens, cut, batch.segment_ids, batch.positions)
    changed = ttt.Batch(batch.tokens.at[:, c + 1:].set((batch.tokens[:, c + 1:] + 7) % 96), cut,
                        batch.segment_ids, batch.positions)
    den = ttt.valid_counts(early, K)

    @jax.jit
    def full_loss(b):
        sig = ttt.target_signals(tw, tcfg, dcfg, va, b)
        return ttt.rollout(w, dcfg, sig, b, va, cfg, den)[0]

    a, b = float(full_loss(early)), float(full_loss(changed))
    assert a == b and a > 0
    sig = signals(tw, tcfg, dcfg, va, early)

    def loss_of(aux, embeds):
        s = ttt.TargetSignals(embeds, aux, sig.probs_BxTxVd, sig.argmax_BxT, sig.in_draft_BxT)
        return ttt.rollout(w, dcfg, s, early, va, cfg, den)[0]

    g_aux, g_emb = jax.jit(jax.grad(loss_of, argnums=(0, 1)))(sig.aux_BxTxA, sig.embeds_BxTxD)
    g_aux, g_emb = np.abs(np.asarray(g_aux)).sum(-1), np.abs(np.asarray(g_emb)).sum(-1)
    assert (g_aux[:, c:] == 0).all() and (g_aux[:, :c] > 0).any()
    assert (g_emb[:, c + 1:] == 0).all() and (g_emb[:, 1:c + 1] > 0).any()
    # nothing crosses the document boundary at 9 in row 0 from the second document
    assert g_aux[0, :9].sum() > 0


def test_fully_masked_batch_gives_zero_loss(setup):
    tcfg, tw, dcfg, w, vocab = setup
    va = VocabArrays.from_map(vocab)
    batch = packed_batch(np.random.default_rng(3))
    empty = ttt.Batch(batch.tokens, jnp.zeros_like(batch.loss_mask), batch.segment_ids,
                      batch.positions)
    cfg = ttt.TTTConfig(steps=K, compute_dtype=jnp.float32)
    loss, counts = jax.jit(functools.partial(ttt.loss_fn, tcfg=tcfg, dcfg=dcfg, ttt=cfg))(
        w, tw, empty, va, ttt.valid_counts(empty, K))
    assert float(loss) == 0.0 and float(counts.total.sum()) == 0.0
    assert np.isfinite(float(loss))
    _ = target  # the frozen target is exercised through loss_fn


def dense_ttt_attention(q, keys, values, segment_ids):
    """The chain-tree attention written out densely: [T, T] step-0 scores plus diagonals."""
    b, t, n, h = q.shape
    kh = keys[0].shape[2]
    qg = q.reshape(b, t, kh, n // kh, h)
    s0 = jnp.einsum("btkgh,bskh->bkgts", qg, keys[0]) / np.sqrt(h)
    s0 = jnp.where(causal_mask(segment_ids)[:, None, None], s0, -1e30)
    diag = [jnp.einsum("btkgh,btkh->bkgt", qg, k_i)[..., None] / np.sqrt(h) for k_i in keys[1:]]
    p = jax.nn.softmax(jnp.concatenate([s0, *diag], axis=-1), axis=-1)
    o = jnp.einsum("bkgts,bskh->btkgh", p[..., :t], values[0])
    for i, v_i in enumerate(values[1:]):
        o = o + jnp.einsum("bkgt,btkh->btkgh", p[..., t + i], v_i)
    return o.reshape(b, t, n, h)


@pytest.mark.parametrize("block", [4])
def test_blockwise_ttt_attention_equals_dense(block):
    """Blocks of query rows (the last one uneven) give the dense attention's
    values and gradients: the XLA path every device runs, checked against the formula."""
    rng = np.random.default_rng(4)
    b, t, n, kh, h, steps = 2, 14, 4, 2, 8, 3
    seg = np.zeros((b, t), np.int32)
    seg[0, :5], seg[0, 5:12], seg[1] = 1, 2, 1
    seg = jnp.asarray(seg)
    q = jnp.asarray(rng.standard_normal((b, t, n, h)), jnp.float32)
    kv = [jnp.asarray(rng.standard_normal((b, t, kh, h)), jnp.float32) for _ in range(2 * steps)]
    keys, values = kv[:steps], kv[steps:]
    assert len(ttt.query_blocks(t, block)) == -(-t // block)

    def loss(f, q, keys, values):
        o = f(q, keys, values, seg)
        return jnp.sum(o * jnp.cos(jnp.arange(o.size).reshape(o.shape)))

    fast = jax.jit(jax.value_and_grad(lambda *a: loss(
        lambda *x: ttt._ttt_attend(*x, block=block), *a), argnums=(0, 1, 2)))(q, keys, values)
    ref = jax.jit(jax.value_and_grad(lambda *a: loss(dense_ttt_attention, *a),
                                     argnums=(0, 1, 2)))(q, keys, values)
    for x, y in zip(jax.tree.leaves(fast), jax.tree.leaves(ref), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=2e-5, atol=2e-5)


@pytest.mark.skipif(jax.default_backend() != "gpu", reason="cuDNN runs on GPUs only")
def test_cudnn_step0_attention_matches_the_xla_path():
    """TTT step 0 and the target through cuDNN (told the mask is causal) against the XLA
    path in fp32, values and gradients, packed documents: bf16 lands under 1e-2.
    Run on a GPU: JAX_PLATFORMS=cuda pytest tests/core/test_ttt.py -k cudnn"""
    rng = np.random.default_rng(5)
    b, t, n, kh, h = 2, 384, 8, 2, 64
    seg = np.ones((b, t), np.int32)
    seg[0, 100:300], seg[0, 300:] = 2, 0
    seg = jnp.asarray(seg)
    q, k, v, ct = (jnp.asarray(rng.standard_normal(s), jnp.float32)
                   for s in [(b, t, n, h), (b, t, kh, h), (b, t, kh, h), (b, t, n, h)])

    def run(f, dtype):
        args = [x.astype(dtype) for x in (q, k, v)]
        out, vjp = jax.vjp(f, *args)
        return [np.asarray(x, np.float32) for x in (out, *vjp(ct.astype(dtype)))]

    ref = run(lambda q, k, v: ttt._ttt_attend(q, [k], [v], seg), jnp.float32)
    fast = run(lambda q, k, v: attend(q, k, v, causal_mask(seg), "cudnn"), jnp.bfloat16)
    for x, y in zip(fast, ref, strict=True):
        assert np.linalg.norm(x - y) / np.linalg.norm(y) < 1e-2


def test_pallas_attention_choice_gives_the_xla_loss_and_gradient(setup):
    """The whole rollout with every TTT step through the fused kernel (interpret mode here)
    equals the XLA choice: loss, counts and the gradient w.r.t. every draft weight, fp32.
    Two steps: step 0 is the kernel alone, step 1 adds the log-sum-exp merge. Summation
    order alone separates them (observed ~1e-6 relative); 2e-5 is far below what a dropped
    lse cotangent makes (test_flash.py holds the kernel itself)."""
    tcfg, tw, dcfg, w, vocab = setup
    va = VocabArrays.from_map(vocab)
    batch = packed_batch(np.random.default_rng(1))
    sig = signals(tw, tcfg, dcfg, va, batch)
    den = ttt.valid_counts(batch, 2)

    def grad(attention):
        cfg = ttt.TTTConfig(steps=2, compute_dtype=jnp.float32, attention=attention)
        return jax.jit(jax.value_and_grad(
            lambda w: ttt.rollout(w, dcfg, sig, batch, va, cfg, den), has_aux=True))(w)

    (loss, counts), g = grad("pallas")
    (ref_loss, ref_counts), ref_g = grad("xla")
    assert float(ref_loss) > 0
    np.testing.assert_allclose(float(loss), float(ref_loss), rtol=2e-5)
    np.testing.assert_array_equal(np.asarray(counts.correct), np.asarray(ref_counts.correct))
    for name in draft_arrays(w):
        a, b = np.asarray(getattr(g, name)), np.asarray(getattr(ref_g, name))
        assert np.abs(b).max() > 0, name
        np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-5 * np.abs(b).max(), err_msg=name)
