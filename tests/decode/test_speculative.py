"""Speculative decoding: the acceptance rules on their own, and the engine with one row (batch
1) on a tiny target, with a random draft (nothing accepted) and with a draft trained to get
tokens accepted (tests/decode/accepting.py: every accepted length occurs, checked against a
cache-free reference).

The greedy losslessness on the real SmolLM2 is in test_smollm2.py.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.stats
from jax.sharding import NamedSharding, PartitionSpec

from eagle3kit.core import target
from eagle3kit.decode.acceptance import acceptance_summary
from eagle3kit.decode.engine import Request
from eagle3kit.decode.speculative import DecodeConfig, accept_greedy, accept_sampled
from eagle3kit.io.hf import load_target, resolve_target
from eagle3kit.jobs.evaluate import generation_mesh
from tests.decode import accepting, engines

# ---- the rules --------------------------------------------------------------------------------


def test_accept_greedy_takes_the_agreeing_prefix_and_the_targets_next_token():
    best = np.array([4, 7, 1, 9])  # target argmax at the K+1 = 4 verify positions
    logits = jnp.asarray(np.eye(10)[best] * 5.0)
    for drafts, a in (([4, 7, 1], 3), ([4, 7, 2], 2), ([5, 7, 1], 0)):
        got_a, bonus = accept_greedy(logits, jnp.asarray(drafts))
        assert int(got_a) == a and int(bonus) == best[a]


def _chain_samples(n: int, temperature: float, q_equals_p: bool = False):
    """n runs of the rule on a 2-token chain over a target vocab of 8 -> the emitted tokens
    [n, 3] (x_j valid where a >= j - 1; x_3 is the bonus after both drafts), a, p [3, 8].

    The target's logits are fixed per position (they ignore the drafts), so x_j given that
    x_1..x_{j-1} were accepted drafts must follow p_{j-1}. The draft vocab is 5 ids (1, 4 and
    7 can only come from the target) with random q, or with `q_equals_p` all 8 ids with q =
    p, so every draft is accepted and every run ends in the bonus token."""
    rng = np.random.default_rng(0)
    target_logits = jnp.asarray(rng.normal(size=(3, 8)) * 1.5)
    p = jax.nn.softmax(target_logits / temperature, axis=-1)
    if q_equals_p:
        used, q = jnp.arange(8), p[:2]
    else:
        used = jnp.asarray([0, 2, 3, 5, 6])
        q = jax.nn.softmax(jnp.asarray(rng.normal(size=(2, 5)) * 1.5), axis=-1)

    def one(key):
        k1, k2, k3 = jax.random.split(key, 3)
        d = jnp.stack([jax.random.categorical(k1, jnp.log(q[0])),
                       jax.random.categorical(k2, jnp.log(q[1]))])
        a, bonus = accept_sampled(k3, target_logits, q, d, used, temperature)
        chain = jnp.concatenate([used[d], bonus[None]])
        return jnp.where(jnp.arange(3) < a, chain, jnp.where(jnp.arange(3) == a, bonus, -1)), a

    x, a = jax.jit(jax.vmap(one))(jax.random.split(jax.random.key(0), n))
    q_t = np.zeros((2, 8))
    q_t[:, np.asarray(used)] = np.asarray(q)
    return np.asarray(x), np.asarray(a), np.asarray(p, np.float64), q_t


def chi_square_p_value(groups) -> float:
    """Pearson's chi-square over (samples, probabilities) groups, one statistic for all:
    bins expecting fewer than 5 samples are pooled; a sample where p = 0 fails outright."""
    stat, dof = 0.0, 0
    for samples, p in groups:
        counts = np.bincount(samples, minlength=len(p)).astype(np.float64)
        assert counts[p == 0].sum() == 0, "a token the target never emits"
        expected = len(samples) * p
        small = expected < 5
        obs = np.r_[counts[~small], counts[small].sum()]
        exp = np.r_[expected[~small], expected[small].sum()]
        keep = exp > 0
        stat += float(((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum())
        dof += int(keep.sum()) - 1
    return float(scipy.stats.chi2.sf(stat, dof))


# Fixed seeds make these tests deterministic; 1e-4 is how unlikely a correct sampler would
# have to be to fail them, while each planted sampling bug gives p-values below 1e-30.
P_MIN = 1e-4


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_speculative_sampling_emits_the_targets_distribution(temperature):
    """Every emitted token, the bonus after a fully accepted chain included, in one test."""
    n = 60000
    x, a, p, q = _chain_samples(n, temperature)
    groups = [(x[a >= j, j], p[j]) for j in range(3)]
    assert min(len(s) for s, _ in groups) > 5000  # full acceptance is common enough
    assert chi_square_p_value(groups) > P_MIN
    # and the draft is accepted as often as the rule allows: P = sum_x min(p(x), q(x))
    for j in (0, 1):
        rate = (a[a >= j] >= j + 1).mean()
        expected = np.minimum(p[j], q[j]).sum()
        assert abs(rate - expected) < 5 * np.sqrt(expected * (1 - expected) / (a >= j).sum())


def test_the_bonus_after_a_fully_accepted_chain_follows_the_target():
    """q = p: every draft is accepted, and the token after them is drawn from p_K itself
    (not from the residual of the last draft's q)."""
    x, a, p, _ = _chain_samples(20000, 0.8, q_equals_p=True)
    assert (a == 2).all()
    assert chi_square_p_value([(x[:, 2], p[2])]) > P_MIN


# ---- the engine on a tiny random target ---------------------------------------------------------
# (stop tokens and limits, one row or many: test_engine_speculative.py; tau's bookkeeping:
# test_tau_is_reported_pooled_and_per_request_with_the_bonus_token and the eval CLI tests)


def test_sampling_through_the_decoder_follows_the_target(tiny):
    """The second generated token comes out of the first verify step (draft chain, q, the
    rule); over many requests (each its own stream) its distribution is the target's
    p(x2 | prompt, x1) averaged over x1 ~ p(x1 | prompt), computed exactly with one batched
    forward."""
    tcfg, tw, dcfg, w, vocab, mesh = tiny
    temperature, n = 0.5, 3000
    prompt = np.random.default_rng(6).integers(0, 96, 9).astype(np.int32)
    dec = DecodeConfig(steps=3, max_new_tokens=2, temperature=temperature)
    engine = engines.speculative(tcfg, tw, dcfg, w, vocab, dec, [], mesh, rows=1024,
                                 max_context=128, sync_every=1, prefill_chunk=16)
    done = engine.generate([Request(j, prompt.tolist(), 2, seed=j) for j in range(n)])
    tokens = np.asarray([c.tokens for c in done])

    def probs(seq):
        out = target.forward(tw, tcfg, jnp.asarray(seq))
        return np.asarray(jax.nn.softmax(target.logits(tw, out.hidden_BxTxD)[:, -1]
                                         / temperature, axis=-1), np.float64)

    p1 = probs(prompt[None])[0]
    p2 = p1 @ probs(np.c_[np.tile(prompt, (96, 1)), np.arange(96)])  # sum_x1 p(x1) p(x2|x1)
    # the tiny target's p is nearly flat over 96 x 96 pairs: too few samples per pair for a
    # joint test, so each token's marginal gets its own (the second one is what the
    # engine's draft chain and rule produce)
    assert chi_square_p_value([(tokens[:, 0], p1)]) > P_MIN
    assert chi_square_p_value([(tokens[:, 1], p2)]) > P_MIN


# ---- the decoder with a draft that gets tokens accepted -------------------------------------


def _accepting_run(acc, engine_for):
    """Each prompt decoded speculatively, one row: the greedy tokens, and the accepted counts
    of every verify step equal to the reference's (so their histogram too); plain decoding
    agrees. `engine_for(dec, plain)` makes the engine."""
    dec = DecodeConfig(steps=accepting.K, max_new_tokens=accepting.NEW)
    engine = engine_for(dec, False)
    histogram = np.zeros(accepting.K + 1, np.int64)
    for prompt, answer, expected in zip(acc.prompts, acc.greedy, acc.accept_lengths,
                                        strict=True):
        got = engines.one(engine, prompt, accepting.NEW)
        assert got.tokens == answer[: accepting.NEW]
        assert got.accept_lengths == expected
        np.add.at(histogram, expected, 1)
    assert engines.one(engine_for(dec, True), acc.prompts[0], accepting.NEW).tokens == \
        acc.greedy[0][: accepting.NEW]
    # every length occurs, full chains included: commit, extend and the next chain's
    # starting column are exercised after every kind of verify step
    assert (histogram > 0).all(), histogram
    return histogram


def test_greedy_with_accepted_drafts_is_lossless_and_accepts_as_the_reference(accepting_draft):
    acc = accepting_draft
    _accepting_run(acc, lambda dec, plain: engines.plain(acc.tcfg, acc.target_w, dec, [],
                                                         acc.mesh) if plain else
                   engines.speculative(acc.tcfg, acc.target_w, acc.dcfg, acc.draft_w,
                                       acc.vocab, dec, [], acc.mesh))


def test_greedy_with_accepted_drafts_on_a_tensor_parallel_target(accepting_draft, tiny_dir):
    """`--mesh tensor=2`: the target's heads split over two devices, the same tokens and
    the same accepted counts."""
    acc = accepting_draft
    split = generation_mesh("tensor=2")
    replicated = NamedSharding(split, PartitionSpec())
    tw2 = load_target(resolve_target(tiny_dir), split, jnp.float32)
    assert tw2.layers.q.sharding.spec[2] == "tensor"
    _accepting_run(acc, lambda dec, plain: engines.plain(acc.tcfg, tw2, dec, [], split)
                   if plain else engines.speculative(
                       acc.tcfg, tw2, acc.dcfg, jax.device_put(acc.draft_w, replicated),
                       jax.device_put(acc.vocab, replicated), dec, [], split))


def test_tau_is_reported_pooled_and_per_request_with_the_bonus_token():
    """Three requests: accepted [3, 0, 1], [0] and none (stopped at its first token).
    Pooled: (4 + 1 + 2 + 1) / 4 steps = 2.0; per request: (7/3 + 1/1) / 2 = 5/3."""
    s = acceptance_summary([[3, 0, 1], [0], []], steps=3)
    assert s["tau_pooled"] == s["tau_generate"] == 2.0
    assert s["tau_per_request_mean"] == pytest.approx(5 / 3, abs=1e-6)
    assert s["accept_rate"] == [0.5, 0.5, 1.0] and s["verify_steps"] == 4
    assert s["accept_histogram"] == [2, 1, 0, 1]
    # the rates multiply back to the pooled tau: 1 + 0.5 + 0.25 + 0.25
    assert 1 + np.cumprod(s["accept_rate"]).sum() == s["tau_pooled"]
    empty = acceptance_summary([[]], steps=2)
    assert empty["tau_pooled"] == empty["tau_per_request_mean"] == 0.0
