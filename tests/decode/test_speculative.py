"""Speculative decoding: the acceptance rules on their own, and the decoder on a tiny target.

The greedy losslessness on the real SmolLM2 is in test_smollm2.py.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from eagle3kit.core import target
from eagle3kit.decode.runner import Decoder, acceptance_summary, bucket
from eagle3kit.decode.speculative import (
    DecodeConfig,
    accept_greedy,
    accept_sampled,
    speculative_generate,
)
from eagle3kit.io.hf import load_target, resolve_target
from eagle3kit.jobs.evaluate import generation_mesh

# ---- the rules --------------------------------------------------------------------------------


def test_accept_greedy_takes_the_agreeing_prefix_and_the_targets_next_token():
    best = np.array([4, 7, 1, 9])  # target argmax at the K+1 = 4 verify positions
    logits = jnp.asarray(np.eye(10)[best] * 5.0)
    for drafts, a in (([4, 7, 1], 3), ([4, 7, 2], 2), ([5, 7, 1], 0)):
        got_a, bonus = accept_greedy(logits, jnp.asarray(drafts))
        assert int(got_a) == a and int(bonus) == best[a]


def _chain_samples(n: int, temperature: float):
    """n runs of the rule on a 2-token chain over a target vocab of 8, draft vocab of 5."""
    rng = np.random.default_rng(0)
    used = jnp.asarray([0, 2, 3, 5, 6])  # 1, 4 and 7 can only come from the target
    target_logits = jnp.asarray(rng.normal(size=(3, 8)) * 1.5)
    q = jax.nn.softmax(jnp.asarray(rng.normal(size=(2, 5)) * 1.5), axis=-1)

    def one(key):
        k1, k2, k3 = jax.random.split(key, 3)
        d = jnp.stack([jax.random.categorical(k1, jnp.log(q[0])),
                       jax.random.categorical(k2, jnp.log(q[1]))])
        a, bonus = accept_sampled(k3, target_logits, q, d, used, temperature)
        first = jnp.where(a >= 1, used[d[0]], bonus)
        second = jnp.where(a >= 2, used[d[1]], bonus)
        return first, second, a

    first, second, a = jax.jit(jax.vmap(one))(jax.random.split(jax.random.key(0), n))
    p = np.asarray(jax.nn.softmax(target_logits / temperature, axis=-1))
    q_t = np.zeros((2, 8))
    q_t[:, np.asarray(used)] = np.asarray(q)
    return np.asarray(first), np.asarray(second), np.asarray(a), p, q_t


def _assert_distributed(samples: np.ndarray, p: np.ndarray, what: str):
    n = len(samples)
    freq = np.bincount(samples, minlength=len(p)) / n
    bound = 5 * np.sqrt(p * (1 - p) / n) + 1e-3  # five standard errors per token
    assert (np.abs(freq - p) <= bound).all(), f"{what}: {freq.round(4)} vs {p.round(4)}"


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_speculative_sampling_emits_the_targets_distribution(temperature):
    n = 60000
    first, second, a, p, q = _chain_samples(n, temperature)
    _assert_distributed(first, p[0], "first token")
    # given d_1 was accepted, the next token follows p_1 (the test's p_1 ignores d_1)
    _assert_distributed(second[a >= 1], p[1], "second token")
    # and the draft is accepted as often as the rule allows: P = sum_x min(p(x), q(x))
    for j in (0, 1):
        rate = (a[a >= j] >= j + 1).mean()
        expected = np.minimum(p[j], q[j]).sum()
        assert abs(rate - expected) < 5 * np.sqrt(expected * (1 - expected) / (a >= j).sum())


# ---- the decoder on a tiny random target --------------------------------------------------------


def test_greedy_stops_at_a_stop_token_and_at_max_new_tokens(tiny):
    tcfg, tw, dcfg, w, vocab, mesh = tiny
    prompt = [int(x) for x in np.random.default_rng(5).integers(0, 96, 11)]
    dec = DecodeConfig(steps=3, max_new_tokens=24)
    free = Decoder(tcfg, dcfg, tw, w, vocab, dec, [], mesh)
    plain = free.plain(prompt).generated_ids
    assert len(plain) == 24 and free.speculative(prompt).generated_ids == plain
    stop_at = next(i for i in range(3, 24) if plain[i] not in plain[:i])
    stopping = Decoder(tcfg, dcfg, tw, w, vocab, dec, [plain[stop_at]], mesh)
    spec = stopping.speculative(prompt)
    assert spec.generated_ids == plain[: stop_at + 1]
    assert stopping.plain(prompt).generated_ids == plain[: stop_at + 1]
    # every verify step emits accepted + 1 tokens after the prefill's first one
    assert sum(a + 1 for a in spec.accept_lengths) >= stop_at
    s = acceptance_summary([spec.accept_lengths], dec.steps)
    assert s["verify_steps"] == len(spec.accept_lengths) == spec.forwards
    assert s["tau_generate"] == pytest.approx(1 + np.mean(spec.accept_lengths), abs=1e-6)


def test_sampling_through_the_decoder_follows_the_target(tiny):
    """The second generated token comes out of the first verify step (draft chain, q, the
    rule); over many seeds its distribution is the target's p(x2 | prompt, x1) averaged over
    x1 ~ p(x1 | prompt), computed exactly with one batched forward."""
    tcfg, tw, dcfg, w, vocab, mesh = tiny


    temperature, n = 0.5, 3000
    prompt = np.random.default_rng(6).integers(0, 96, 9).astype(np.int32)
    padded = np.zeros(bucket(len(prompt)), np.int32)
    padded[: len(prompt)] = prompt
    dec = DecodeConfig(steps=3, max_new_tokens=2, temperature=temperature)
    gen = functools.partial(speculative_generate, tcfg=tcfg, dcfg=dcfg, dec=dec, cache_len=128)
    run = jax.jit(jax.vmap(lambda key: gen(tw, w, vocab, jnp.asarray(padded), jnp.int32(9),
                                           jnp.int32(2), jnp.asarray([-1]), key).tokens[9:11]))
    tokens = np.asarray(run(jax.random.split(jax.random.key(1), n)))

    def probs(seq):
        out = target.forward(tw, tcfg, jnp.asarray(seq))
        return np.asarray(jax.nn.softmax(target.logits(tw, out.hidden_BxTxD)[:, -1]
                                         / temperature, axis=-1), np.float64)

    p1 = probs(prompt[None])[0]
    p2 = p1 @ probs(np.c_[np.tile(prompt, (96, 1)), np.arange(96)])  # sum_x1 p(x1) p(x2|x1)
    _assert_distributed(tokens[:, 0], p1, "first token (prefill)")
    _assert_distributed(tokens[:, 1], p2, "second token (first verify step)")


def test_a_tensor_parallel_target_decodes_the_same(tiny, tiny_dir):
    """`--mesh tensor=2`: the target's heads split over two devices, the same tokens."""
    tcfg, tw, dcfg, w, vocab, mesh = tiny
    split = generation_mesh("tensor=2")
    replicated = NamedSharding(split, PartitionSpec())
    tw2 = load_target(resolve_target(tiny_dir), split, jnp.float32)
    assert tw2.layers.q.sharding.spec[2] == "tensor"
    dec = DecodeConfig(steps=3, max_new_tokens=16)
    prompt = [int(x) for x in np.random.default_rng(8).integers(0, 96, 11)]
    one = Decoder(tcfg, dcfg, tw, w, vocab, dec, [], mesh).speculative(prompt)
    two = Decoder(tcfg, dcfg, tw2, jax.device_put(w, replicated),
                  jax.device_put(vocab, replicated), dec, [], split)
    assert two.speculative(prompt).generated_ids == one.generated_ids
    assert two.plain(prompt).generated_ids == one.generated_ids


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
