"""Greedy speculative decoding of the real SmolLM2-135M-Instruct (fp32 on CPU) is lossless.

The reference is a plain host loop over `core.target.forward_cached` (tests/smollm2_draft.py),
independent of `eagle3kit.decode`. A trained draft and an untrained one must both reproduce
it token for token; only how many tokens each verify step accepts differs.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from eagle3kit.core.draft import DraftWeights
from eagle3kit.core.sharding import init_weights
from eagle3kit.core.ttt import VocabArrays
from eagle3kit.decode.runner import Decoder, acceptance_summary
from eagle3kit.decode.speculative import DecodeConfig
from tests import smollm2_draft

pytestmark = pytest.mark.slow
K = 5
LIMIT = 16  # new tokens where a whole answer is not needed


@pytest.fixture(scope="module")
def trained(smollm2_trained_draft):
    t = smollm2_draft.smollm2()
    d = smollm2_trained_draft
    weights = jax.tree.map(jnp.asarray, d.draft.weights)
    dec = DecodeConfig(steps=K, max_new_tokens=smollm2_draft.ANSWER_TOKENS)
    return Decoder(t.cfg, d.draft.config, t.weights, weights, VocabArrays.from_map(d.draft.vocab),
                   dec, [smollm2_draft.EOS], t.mesh), d


def test_trained_draft_is_lossless_and_accepts_long_runs(trained):
    decoder, d = trained
    results = [decoder.speculative(p) for p in d.prompts]
    for r, answer in zip(results, d.answers, strict=True):
        assert r.generated_ids == answer
        # the prefill gives one token, each verify step accepted + 1
        assert 1 + sum(a + 1 for a in r.accept_lengths) >= len(answer)
        assert all(0 <= a <= K for a in r.accept_lengths)
    lengths = [r.accept_lengths for r in results]
    summary = acceptance_summary(lengths, K)
    assert summary["tau_generate"] > 2.5, summary
    assert summary["accept_histogram"][K] > 0  # whole chains accepted, the bonus after them
    assert summary["accept_histogram"][0] > 0  # and rejections at the first token


def test_random_draft_is_lossless_too(trained):
    decoder, d = trained
    random = init_weights(DraftWeights.abstract(d.draft.config), jax.random.key(42))
    r = decoder.with_draft(random).speculative(d.prompts[0], limit=LIMIT)  # one token a step
    assert r.generated_ids == d.answers[0][:LIMIT]
    assert acceptance_summary([r.accept_lengths], K)["tau_generate"] < 1.3


def test_plain_decoding_loop_equals_the_reference(trained):
    decoder, d = trained
    r = decoder.plain(d.prompts[1], limit=LIMIT)
    assert r.generated_ids == d.answers[1][:LIMIT]
    assert r.forwards == LIMIT - 1 and r.accept_lengths == []
    assert np.isfinite(r.seconds) and r.seconds > 0


def test_trained_draft_in_trees_is_lossless(trained):
    """SGLang's S=5, k=4, N=8 tree on the real target: the target's own greedy answer, with
    runs of tokens accepted along branches."""
    decoder, d = trained
    dec = DecodeConfig(steps=K, max_new_tokens=smollm2_draft.ANSWER_TOKENS, topk=4,
                       draft_tokens=8)
    trees = Decoder(decoder.tcfg, decoder.dcfg, decoder.target_w, decoder.draft_w,
                    decoder.vocab, dec, [smollm2_draft.EOS], decoder.mesh)
    prompt, answer = d.prompts[0], d.answers[0]
    tree = trees.speculative(prompt)
    assert tree.generated_ids == answer
    assert all(0 <= a <= K for a in tree.accept_lengths)
    assert acceptance_summary([tree.accept_lengths], K)["tau_pooled"] > 2.5


def test_batched_trees_of_four_rows_are_lossless(trained):
    """decode/spec_engine.py: the 5/4/8 tree over 4 rows, six requests (each prompt with
    three limits: refill, rows ending at different steps): the target's own greedy answers."""
    from eagle3kit.decode.engine import Request
    from eagle3kit.decode.spec_engine import SpecEngine, SpecEngineConfig

    decoder, d = trained
    dec = DecodeConfig(steps=K, max_new_tokens=smollm2_draft.ANSWER_TOKENS, topk=4,
                       draft_tokens=8)
    slots = -(-(max(map(len, d.prompts)) + dec.max_new_tokens + 9) // 128) * 128
    engine = SpecEngine(decoder.tcfg, decoder.dcfg, decoder.target_w, decoder.draft_w,
                        decoder.vocab, dec, [smollm2_draft.EOS], decoder.mesh,
                        SpecEngineConfig(rows=4, max_context=slots, sync_every=4))
    limits = (dec.max_new_tokens, 11, 23)
    requests = [Request((i, n), p, n) for n in limits for i, p in enumerate(d.prompts)]
    done = engine.generate(requests)
    assert [c.tokens for c in done] == [d.answers[i][:n] for i, n in (r.handle for r in requests)]
    assert acceptance_summary([c.accept_lengths for c in done], K)["tau_pooled"] > 2.5
