"""Greedy speculative decoding of the real SmolLM2-135M-Instruct (fp32 on CPU) is lossless.

The reference is a plain host loop over `core.row_cache.forward_rows` (tests/smollm2_draft.py),
independent of `eagle3kit.decode`. A trained draft and an untrained one, chains and SGLang's
5/4/8 trees, must all reproduce it token for token through the engine (rows refilled, rows
ending at different steps); only how many tokens each verify step accepts differs. The plain
engine on SmolLM2 is test_engine.py's (against transformers).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from eagle3kit.core.draft import DraftWeights
from eagle3kit.core.sharding import init_weights
from eagle3kit.core.vocab_arrays import VocabArrays
from eagle3kit.decode.acceptance import acceptance_summary
from eagle3kit.decode.engine import Request
from eagle3kit.decode.speculative import DecodeConfig
from tests import smollm2_draft
from tests.decode import engines

pytestmark = pytest.mark.slow
K = 5
LIMIT = 16  # new tokens where a whole answer is not needed
CHAIN = DecodeConfig(steps=K, max_new_tokens=smollm2_draft.ANSWER_TOKENS)


@pytest.fixture(scope="module")
def trained(smollm2_trained_draft):
    t = smollm2_draft.smollm2()
    d = smollm2_trained_draft
    weights = jax.tree.map(jnp.asarray, d.draft.weights)
    slots = engines.slots_for(max(map(len, d.prompts)), CHAIN)

    def engine(dec, draft_w=weights, rows=4):  # one shape: the programs are shared
        return engines.speculative(t.cfg, t.weights, d.draft.config, draft_w,
                                   VocabArrays.from_map(d.draft.vocab), dec,
                                   [smollm2_draft.EOS], t.mesh, rows=rows, max_context=slots,
                                   sync_every=4)
    return engine, d


def test_trained_draft_is_lossless_and_accepts_long_runs(trained):
    engine, d = trained
    results = engine(CHAIN).generate([Request(i, p, CHAIN.max_new_tokens)
                                      for i, p in enumerate(d.prompts)])
    for r, answer in zip(results, d.answers, strict=True):
        assert r.tokens == answer
        # the prefill gives one token, each verify step accepted + 1
        assert 1 + sum(a + 1 for a in r.accept_lengths) >= len(answer)
        assert all(0 <= a <= K for a in r.accept_lengths)
    lengths = [r.accept_lengths for r in results]
    summary = acceptance_summary(lengths, K)
    assert summary["tau_generate"] > 2.5, summary
    assert summary["accept_histogram"][K] > 0  # whole chains accepted, the bonus after them
    assert summary["accept_histogram"][0] > 0  # and rejections at the first token


def test_random_draft_is_lossless_too(trained):
    engine, d = trained
    random = init_weights(DraftWeights.abstract(d.draft.config), jax.random.key(42))
    r = engines.one(engine(CHAIN, random), d.prompts[0], LIMIT)  # one token a step
    assert r.tokens == d.answers[0][:LIMIT]
    assert acceptance_summary([r.accept_lengths], K)["tau_generate"] < 1.3


def test_batched_trees_of_four_rows_are_lossless(trained):
    """SGLang's 5/4/8 tree over 4 rows, six requests (each prompt with three limits: refill,
    rows ending at different steps): the target's own greedy answers, with runs of tokens
    accepted along branches."""
    engine, d = trained
    dec = DecodeConfig(steps=K, max_new_tokens=smollm2_draft.ANSWER_TOKENS, topk=4,
                       draft_tokens=8)
    limits = (dec.max_new_tokens, 11, 23)
    requests = [Request((i, n), p, n) for n in limits for i, p in enumerate(d.prompts)]
    done = engine(dec).generate(requests)
    assert [c.tokens for c in done] == [d.answers[i][:n] for i, n in (r.handle for r in requests)]
    assert all(0 <= a <= K for c in done for a in c.accept_lengths)
    assert acceptance_summary([c.accept_lengths for c in done], K)["tau_pooled"] > 2.5
