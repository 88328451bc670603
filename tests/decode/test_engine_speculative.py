"""Batched speculative decoding (decode/engine.py with a draft) on the tiny target with a draft that
gets tokens accepted (tests/decode/accepting.py).

fp32: greedy chains and trees must give plain greedy decoding's tokens for every request,
with fewer rows than requests (refill), rows that end at different steps (limits, a stop
token, a limit of 1), and each request's accepted counts must equal those of one row at a time (batch 1).
Sampled chains must not depend on the number of rows, and must draw fresh randomness at
every verify step. Rows whose verify programs cross a window boundary keep plain greedy's
tokens on a target whose answers depend on every key (`chaotic`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from eagle3kit.core.sharding import make_mesh
from eagle3kit.decode import row_cache
from eagle3kit.decode.acceptance import acceptance_summary
from eagle3kit.decode.engine import Request
from eagle3kit.decode.speculative import DecodeConfig
from tests.decode import accepting, engines
from tests.decode.hf_reference import greedy_divergence, repeat_zscores

SLOTS = 256  # > 128: verify programs read a window of 128 slots (prompt 11 + 24 new fit)
CHAIN = DecodeConfig(steps=accepting.K, max_new_tokens=accepting.NEW)
TREE = DecodeConfig(steps=accepting.K, max_new_tokens=accepting.NEW, topk=2, draft_tokens=6)
# (prompt index, limit): more requests than rows, ends at different steps
REQUESTS = ((0, 24), (1, 24), (2, 24), (0, 10), (2, 17), (1, 2), (0, 1))


def _run(acc, dec, rows, requests, stops=(), mesh=None, target_w=None, draft_w=None,
         vocab=None, sync_every=4, check_every=1, engine=None):
    engine = engine or engines.speculative(acc.tcfg, target_w or acc.target_w, acc.dcfg,
                                           draft_w or acc.draft_w, vocab or acc.vocab, dec,
                                           stops, mesh or acc.mesh, rows=rows,
                                           max_context=SLOTS, sync_every=sync_every,
                                           check_every=check_every)
    return engine.generate(requests)


def _requests(acc, seed=0):
    return [Request(j, acc.prompts[i], limit, seed=seed + j)
            for j, (i, limit) in enumerate(REQUESTS)]


@pytest.fixture(scope="module")
def chain_run(accepting_draft):
    acc = accepting_draft
    stops = {accepting.stop_token(acc)}
    return acc, stops, _run(acc, CHAIN, 2, _requests(acc), stops)


def test_batched_greedy_chain_is_plain_greedy_with_refill_limits_and_stops(chain_run):
    acc, stops, done = chain_run
    for (i, limit), c in zip(REQUESTS, done, strict=True):
        expected = accepting.expected(acc, i, limit, stops)
        assert c.tokens == expected, (i, limit)
        assert c.finish_reason == ("stop" if expected[-1] in stops else "length")
    assert any(c.finish_reason == "stop" for c in done)


def test_batched_accepted_counts_equal_the_batch1_decoders(chain_run):
    """Per request (so the histogram too): the same verify steps as batch-1 decoding."""
    acc, stops, done = chain_run
    batch1 = [c.accept_lengths for c in _run(acc, CHAIN, 1, _requests(acc), stops)]
    assert [c.accept_lengths for c in done] == batch1
    hist = acceptance_summary([c.accept_lengths for c in done], accepting.K)["accept_histogram"]
    assert hist == acceptance_summary(batch1, accepting.K)["accept_histogram"]
    assert all(h > 0 for h in hist), hist  # every accepted length occurs, full chains too


def test_verify_programs_that_check_every_two_steps_give_the_same_answers(chain_run):
    """EngineConfig(check_every=2): a program decides whether to end only every 2 verify
    steps, so rows that finished (a limit, a stop token) idle through up to one more step
    before a refill; every request's tokens and accepted counts stay those of check_every=1."""
    acc, stops, done = chain_run
    every2 = _run(acc, CHAIN, 2, _requests(acc), stops, check_every=2)
    assert [c.tokens for c in every2] == [c.tokens for c in done]
    assert [c.accept_lengths for c in every2] == [c.accept_lengths for c in done]


def test_batched_greedy_tree_is_plain_greedy_and_caches_hold_the_committed_keys(
        accepting_draft):
    """Tokens as plain greedy; then, two more requests (row i takes request i): each row's
    target cache below its position holds exactly the keys of its committed sequence, so
    every accepted path's keys were moved to contiguous slots, in every row."""
    acc = accepting_draft
    engine = engines.speculative(acc.tcfg, acc.target_w, acc.dcfg, acc.draft_w, acc.vocab, TREE,
                                 [], acc.mesh, rows=2, max_context=SLOTS, sync_every=4)
    done = engine.generate(_requests(acc))
    for (i, limit), c in zip(REQUESTS, done, strict=True):
        assert c.tokens == acc.greedy[i][:limit], (i, limit)
    assert sum(sum(c.accept_lengths) for c in done) > 10  # paths were committed
    assert {p[3] for p in engine.programs if p[0] == "verify"} == {128}  # a window < SLOTS
    engine.generate([Request("a", acc.prompts[0], 24), Request("b", acc.prompts[2], 24)])
    n = np.asarray(engine.state.position)
    for row, i in enumerate((0, 2)):
        seq = jnp.asarray([acc.prompts[i] + acc.greedy[i]])  # the committed ones and more
        cache = row_cache.RowCache.zeros(acc.tcfg, 1, SLOTS, jnp.float32)
        cache = jax.jit(lambda w, s, c: row_cache.forward_rows(
            w, acc.tcfg, s, jnp.arange(s.shape[1])[None], c, prefill=True)[1])(
            engine.w, seq, cache)
        for got, want in zip(engine.cache.k, cache.k, strict=True):
            np.testing.assert_allclose(got[row, : n[row]], want[0, : n[row]], atol=1e-5,
                                       rtol=1e-5)


def test_sampled_chain_does_not_depend_on_the_rows_or_their_devices(accepting_draft):
    """T = 0.8: one row on one device, then four rows split over data=2 (two rows per
    device): every request's tokens and accepted counts are the same."""
    acc = accepting_draft
    dec = DecodeConfig(steps=accepting.K, max_new_tokens=accepting.NEW, temperature=0.8)
    one = _run(acc, dec, 1, _requests(acc, seed=5))
    mesh = make_mesh("data=2,tensor=1", jax.devices()[:2])
    put = lambda x: jax.device_put(x, NamedSharding(mesh, PartitionSpec()))  # noqa: E731
    four = _run(acc, dec, 4, _requests(acc, seed=5), mesh=mesh, target_w=put(acc.target_w),
                draft_w=put(acc.draft_w), vocab=put(acc.vocab))
    assert [c.tokens for c in one] == [c.tokens for c in four]
    assert [c.accept_lengths for c in one] == [c.accept_lengths for c in four]
    # sampled, not greedy: some answer leaves the greedy one
    assert any(c.tokens != acc.greedy[i][: len(c.tokens)]
               for (i, _), c in zip(REQUESTS, one, strict=True))


def test_verify_programs_whose_rows_cross_a_window_boundary_stay_plain_greedy(tiny, chaotic):
    """A verify program works on a window of the cache sized to where its rows can write
    during the whole program. Here 16 verify steps start a few slots below 128 (prompts of
    116 and 112 tokens), so the later ones write past 128 however few drafts are accepted.
    On the context-sensitive tiny Llama (`chaotic`, drafted by `tiny`'s random draft) a key
    that lands in the wrong slot changes the answer: greedy chains must stay transformers'
    greedy tokens. (192 slots: every correct program reads all of them, one program.)"""
    tcfg, _, dcfg, draft_w, vocab, mesh = tiny
    model, target_w = chaotic
    rng = np.random.default_rng(2)
    prompts = [[int(x) for x in rng.integers(0, tcfg.vocab_size, n)] for n in (116, 112)]
    engine = engines.speculative(tcfg, target_w, dcfg, draft_w, vocab, CHAIN, [], mesh, rows=2,
                                 max_context=192, sync_every=16)
    done = engine.generate([Request(i, p, 40) for i, p in enumerate(prompts)])
    for p, c in zip(prompts, done, strict=True):
        assert len(c.tokens) == 40
        at = greedy_divergence(model, p, c.tokens)
        assert at is None, f"prompt of {len(p)} tokens: leaves greedy decoding at token {at}"


def test_the_ragged_kernel_verifies_every_length_with_one_program(tiny, chaotic, chain_run):
    """EngineConfig(attention="pallas"), the GPU's path (interpret mode here): the kernel
    reads each row to its own length, so one verify program serves every length (the draft
    attends over its whole cache), where one per window bucket compiled the same step again
    (an eval's every drafting shape paid each). Rows that grow past 128 and 192 slots stay
    transformers' greedy tokens on `chaotic`, and the trained draft's requests keep the XLA
    path's tokens and accepted counts (a draft cache the program lost would lose those)."""
    tcfg, _, dcfg, draft_w, vocab, mesh = tiny
    model, target_w = chaotic
    rng = np.random.default_rng(2)
    prompts = [[int(x) for x in rng.integers(0, tcfg.vocab_size, n)] for n in (116, 112)]
    engine = engines.speculative(tcfg, target_w, dcfg, draft_w, vocab, CHAIN, [], mesh, rows=2,
                                 max_context=SLOTS, sync_every=4, attention="pallas")
    done = engine.generate([Request(i, p, 100) for i, p in enumerate(prompts)])
    for p, c in zip(prompts, done, strict=True):
        assert len(c.tokens) == 100 and len(p) + 100 > 192
        at = greedy_divergence(model, p, c.tokens)
        assert at is None, f"prompt of {len(p)} tokens: leaves greedy decoding at token {at}"
    assert [p for p in engine.programs if p[0] == "verify"] == [("verify", 2, 4, SLOTS)]
    acc, stops, xla = chain_run
    kernel = _run(acc, CHAIN, 2, _requests(acc), engine=engines.speculative(
        acc.tcfg, acc.target_w, acc.dcfg, acc.draft_w, acc.vocab, CHAIN, stops, acc.mesh,
        rows=2, max_context=SLOTS, sync_every=4, attention="pallas"))
    assert [c.tokens for c in kernel] == [c.tokens for c in xla]
    assert [c.accept_lengths for c in kernel] == [c.accept_lengths for c in xla]


def test_sampled_streams_draw_fresh_randomness_at_every_verify_step(tiny, tiny_dir):
    """T = 0.8 on the tiny target, whose next-token distributions are nearly flat, drafted by
    `tiny`'s random draft: the emitted tokens are draws from the target's distributions (the
    speculative-sampling rule), so a token equals the one l places before it about as often
    as those probabilities say (hf_reference.repeat_zscores, l = 1..8, past one verify
    step's K + 1 tokens). A row that reuses its uniforms at every verify step proposes,
    accepts and draws the same way again and repeats itself."""
    import transformers

    tcfg, _, dcfg, draft_w, vocab, mesh = tiny
    dec = DecodeConfig(steps=accepting.K, max_new_tokens=accepting.NEW, temperature=0.8)
    rng = np.random.default_rng(4)
    prompts = [[int(x) for x in rng.integers(0, tcfg.vocab_size, 11)] for _ in range(4)] * 2
    engine = engines.speculative(tcfg, tiny[1], dcfg, draft_w, vocab, dec, [], mesh, rows=1,
                                 max_context=SLOTS, sync_every=4)
    done = engine.generate([Request(j, p, 24, seed=j) for j, p in enumerate(prompts)])
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_dir).eval()
    z = repeat_zscores(model, prompts, [c.tokens for c in done], 0.8, range(1, 9))
    assert max(abs(v) for v in z.values()) < 5, z
