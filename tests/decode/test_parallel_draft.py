"""Speculative decoding with a parallel drafter (decode/parallel_draft.py: P-EAGLE, DFlash) in
the one engine, on the tiny target with drafts that get blocks accepted
(tests/decode/parallel_drafts.py).

fp32: greedy decoding must give plain greedy decoding's tokens for every request, at batch 1
and with fewer rows than requests (refill), rows ending at different steps (limits, a stop
token, a limit of 1); each request's accepted counts must equal those of the method's own
uncached forward spelled out step by step, at any number of rows."""

from __future__ import annotations

import pytest

from eagle3kit.decode.engine import Request
from eagle3kit.decode.speculative import DecodeConfig
from tests.decode import accepting, engines, parallel_drafts

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
