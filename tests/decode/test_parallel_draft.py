"""Speculative decoding with a parallel drafter (decode/parallel_draft.py: P-EAGLE, DFlash) in
the one engine, on the tiny target with drafts that get blocks accepted
(tests/decode/parallel_drafts.py).

fp32: greedy decoding must give plain greedy decoding's tokens for every request, at batch 1
and with fewer rows than requests (refill), rows ending at different steps (limits, a stop
token, a limit of 1); each request's accepted counts must equal those of the method's own
uncached forward spelled out step by step, at any number of rows.

Sampled (temperature > 0): every emitted token follows the target's own distribution given
the tokens before it (chi-square, the method of test_speculative.py), each proposal of a block
is accepted as often as the speculative-sampling rule allows, sum_x min(p, q), and a rejected
one is replaced by a draw from the residual norm(max(0, p - q))."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from eagle3kit.core import target
from eagle3kit.decode.engine import Engine, EngineConfig, Request, Sampling
from eagle3kit.decode.speculative import DecodeConfig, Speculation
from tests.decode import accepting, engines, parallel_drafts
from tests.decode.test_speculative import P_MIN, chi_square_p_value

SLOTS = 256
# (prompt index, limit): more requests than rows, ends at different steps
REQUESTS = ((0, 24), (1, 24), (2, 24), (0, 10), (2, 17), (1, 2), (0, 1))
METHODS = ("peagle", "dflash")


@pytest.fixture(scope="module", params=METHODS)
def drafted(request, accepting_draft):
    return parallel_drafts.build(accepting_draft, request.param)


def _generate(par, rows: int, requests, stops=(), steps: int = 3, sync_every: int = 4):
    acc = par.acc
    dec = DecodeConfig(steps=steps, max_new_tokens=accepting.NEW)
    engine = engines.speculative(acc.tcfg, acc.target_w, par.dcfg, par.draft_w, acc.vocab, dec,
                                 stops, acc.mesh, rows=rows, max_context=SLOTS,
                                 sync_every=sync_every)
    return engine.generate(requests)


def test_blocks_get_accepted_and_some_are_cut(drafted):
    """What makes the tests below able to fail: whole blocks and partial ones."""
    counts = [a for lengths in drafted.accept_lengths for a in lengths]
    assert max(counts) == 3 and {1, 2} & set(counts) and 0 in counts, counts


@pytest.mark.parametrize("rows", [1, 3])
def test_greedy_block_decoding_is_plain_greedy_with_refill_limits_and_stops(drafted, rows):
    acc = drafted.acc
    stops = {accepting.stop_token(acc)}
    requests = [Request(j, acc.prompts[i], limit, seed=j)
                for j, (i, limit) in enumerate(REQUESTS)]
    done = _generate(drafted, rows, requests, stops)
    for (i, limit), c in zip(REQUESTS, done, strict=True):
        expected = accepting.expected(acc, i, limit, stops)
        assert c.tokens == expected, (rows, i, limit)
        assert c.finish_reason == ("stop" if expected[-1] in stops else "length")
    assert any(c.finish_reason == "stop" for c in done)
    # the full answers (no stop token): every verify step's accepted count is the block
    # the method's uncached forward proposes
    for (i, limit), c in zip(REQUESTS[:3], done[:3], strict=True):
        if limit == accepting.NEW and c.finish_reason == "length":
            assert c.accept_lengths == drafted.accept_lengths[i], (rows, i)


def test_fewer_proposals_than_the_block_verify_a_prefix_of_it(drafted):
    acc = drafted.acc
    requests = [Request(j, p, accepting.NEW, seed=j) for j, p in enumerate(acc.prompts)]
    done = _generate(drafted, 2, requests, steps=2)
    for i, c in enumerate(done):
        assert c.tokens == acc.greedy[i][: accepting.NEW]
        assert max(c.accept_lengths) <= 2


def test_a_block_the_draft_cannot_propose_is_refused(drafted):
    with pytest.raises(ValueError, match="proposes 3 tokens a pass, not 4"):
        _generate(drafted, 1, [], steps=4)


# ---- sampling ---------------------------------------------------------------------------


@pytest.mark.parametrize("sampling", [Sampling(0.8, top_p=0.9), Sampling(0.8, top_k=5)])
def test_a_block_is_not_sampled_under_top_p_or_top_k(drafted, sampling):
    """Speculative sampling is exact for q and p at the temperature alone: truncated
    sampling with a draft is refused, not run inexactly (`eval` has no --top-p, --top-k)."""
    acc = drafted.acc
    spec = Speculation(drafted.dcfg, drafted.draft_w, acc.vocab,
                       DecodeConfig(steps=3, temperature=0.8))
    with pytest.raises(ValueError, match=r"no top-p, top-k"):
        Engine(acc.tcfg, acc.target_w, acc.mesh, [],
               EngineConfig(rows=1, max_context=128, sampling=sampling), spec)


# The tiny target's logits, and the drafts', are nearly flat (a spread of about 0.1): at this
# temperature they are about as peaked as a real model's at 1, so sampled prefixes repeat,
# each often enough to test the token after it, and the drafts' q is neither flat nor
# one-hot (a draft's argmax then differs from a draw from q).
TEMPERATURE = 0.05
SAMPLED = 2000  # requests of one prompt, each its own stream
SAMPLED_NEW = 4  # the prefill's token, then the first verify step's (and the next's when cut)
GROUP = 20  # the fewest samples after one prefix that get tested


@functools.partial(jax.jit, static_argnums=0)
def _target_logits(tcfg, tw, tokens_BxT):
    return target.logits(tw, target.forward(tw, tcfg, tokens_BxT).hidden_BxTxD)


def _softmax64(logits) -> np.ndarray:
    x = np.asarray(logits, np.float64) / TEMPERATURE
    x = np.exp(x - x.max(-1, keepdims=True))
    return x / x.sum(-1, keepdims=True)


@pytest.fixture(scope="module")
def sampled(drafted):
    """SAMPLED answers of SAMPLED_NEW tokens to prompt 0 at TEMPERATURE, on 500 rows
    (refill) -> (tokens [n, NEW], the first verify step's accepted count [n], the target's
    p before each token [n, NEW, V] (float64), q of the block after prompt + x_1 per x_1
    {x_1: [3, V]})."""
    acc = drafted.acc
    prompt = acc.prompts[0]
    dec = DecodeConfig(steps=3, max_new_tokens=SAMPLED_NEW, temperature=TEMPERATURE)
    engine = engines.speculative(acc.tcfg, acc.target_w, drafted.dcfg, drafted.draft_w,
                                 acc.vocab, dec, [], acc.mesh, rows=500, max_context=128,
                                 sync_every=2)
    done = engine.generate([Request(j, prompt, SAMPLED_NEW, seed=j) for j in range(SAMPLED)])
    tokens = np.asarray([c.tokens for c in done])
    first = np.asarray([c.accept_lengths[0] for c in done])
    seqs = np.c_[np.tile(prompt, (SAMPLED, 1)), tokens].astype(np.int32)
    logits = _target_logits(acc.tcfg, acc.target_w, jnp.asarray(seqs))
    p = _softmax64(logits[:, len(prompt) - 1: -1])
    used = np.asarray(acc.vocab.draft_to_target)
    q = {}
    for x1 in np.unique(tokens[:, 0]):
        padded = np.zeros((1, accepting.T), np.int32)
        padded[0, : len(prompt) + 1] = [*prompt, x1]
        block = parallel_drafts._block(acc.tcfg, acc.target_w, drafted.dcfg, drafted.draft_w,
                                       acc.vocab, jnp.asarray(padded), len(prompt))
        q[int(x1)] = np.zeros((3, acc.tcfg.vocab_size))
        q[int(x1)][:, used] = _softmax64(block)
    return tokens, first, p, q


def test_sampled_tokens_follow_the_targets_distribution(sampled):
    """Each token given the tokens before it (every prefix with GROUP samples or more:
    the prefill's token, accepted proposals at every depth, residual and bonus draws) is
    distributed as p(. | prompt, prefix); one chi-square statistic for all."""
    tokens, first, p, _ = sampled
    groups, tested = [(tokens[:, 0], p[0, 0])], []
    for j in range(1, SAMPLED_NEW):
        _, at, count = np.unique(tokens[:, :j], axis=0, return_inverse=True,
                                 return_counts=True)
        at = at.reshape(-1)
        groups += [(tokens[at == g, j], p[np.argmax(at == g), j])
                   for g in np.flatnonzero(count >= GROUP)]
        tested.append(count[count >= GROUP].sum())
    # what makes it able to fail: most second tokens and many third ones are tested (the
    # first and second proposals' acceptance, residual and bonus draws), whole blocks and
    # cut ones occur
    assert tested[0] > 0.8 * SAMPLED and tested[1] > 0.1 * SAMPLED, tested
    assert (first == 3).sum() > 20 and (first == 0).mean() > 0.2, np.bincount(first)
    assert chi_square_p_value(groups) > P_MIN


def test_proposals_are_accepted_as_often_as_the_rule_allows(sampled):
    """The first verify step: proposal j, drawn from q_j (the block after prompt + x_1),
    is accepted given d_1..d_{j-1} were with probability sum_x min(p(x | prompt, x_1,
    d_1..d_{j-1}), q_j(x)); at each depth the accepted count stays within 5 sigma of
    those probabilities summed."""
    tokens, first, p, q = sampled
    for j in (1, 2, 3):
        reached = np.flatnonzero(first >= j - 1)
        qj = np.stack([q[int(x1)][j - 1] for x1 in tokens[reached, 0]])
        rate = np.minimum(p[reached, j], qj).sum(-1)
        taken = (first[reached] >= j).sum()
        assert len(reached) > 100, j
        z = (taken - rate.sum()) / np.sqrt((rate * (1 - rate)).sum())
        assert abs(z) < 5, (j, taken, rate.sum())


def test_a_rejected_proposal_is_replaced_by_a_draw_from_the_residual(sampled):
    """Given that the first verify step accepted j - 1 proposals and rejected the j-th, the
    token in its place follows norm(max(0, p - q_j)) (p after the prefix, q_j the block's
    after prompt + x_1): one chi-square over every prefix with GROUP samples or more. A
    token where q_j >= p (residual 0) fails at once."""
    tokens, first, p, q = sampled
    groups = []
    for j in (1, 2, 3):
        cut = np.flatnonzero(first == j - 1)
        _, at, count = np.unique(tokens[cut, :j], axis=0, return_inverse=True,
                                 return_counts=True)
        at = at.reshape(-1)
        for g in np.flatnonzero(count >= GROUP):
            i = cut[at == g]
            r = np.maximum(p[i[0], j] - q[int(tokens[i[0], 0])][j - 1], 0.0)
            groups.append((tokens[i, j], r / r.sum()))
    assert sum(len(s) for s, _ in groups) > 0.4 * (first < 3).sum()
    assert chi_square_p_value(groups) > P_MIN
