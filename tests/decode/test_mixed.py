"""Mixed steps (decode/mixed.py): prompt pieces riding in the decode steps of the rows that
decode must give the answers of prefilling them by programs of their own, token for token
(fp32), on the context-sensitive tiny Llama (`chaotic`), where a key written to the wrong
slot, a piece read before the one it follows, or a row going live a step late changes them.
"""

from __future__ import annotations

import collections
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from eagle3kit.core import target
from eagle3kit.decode import mixed, row_cache
from eagle3kit.decode.engine import Engine, EngineConfig, Request, Sampling
from eagle3kit.decode.steps import logits
from tests.decode.hf_reference import greedy_divergence

# pieces of 8 tokens, 2 a step; programs of 4 steps: a prompt of more than 64 tokens
# spans programs, one of more than 16 spans steps, shorter ones share a step
MIXED = dict(mixed_budget=16, mixed_piece=8)
LENGTHS = (5, 90, 17, 40, 9, 33, 3, 21, 12)


def prompts(lengths=LENGTHS, seed=4):
    rng = np.random.default_rng(seed)
    return [[int(x) for x in rng.integers(0, 96, n)] for n in lengths]


def run(tcfg, w, mesh, ps, rows, limits, **extra):
    engine = Engine(tcfg, w, mesh, [], EngineConfig(rows=rows, max_context=128, sync_every=4,
                                                    prefill_chunk=32, **extra))
    got = engine.generate([Request(i, p, n, 7 * i) for i, (p, n) in
                           enumerate(zip(ps, limits, strict=True))])
    return engine, [c.tokens for c in got]


def test_mixed_steps_answer_greedy_as_prefill_programs(tiny, chaotic):
    """Nine prompts (3 to 90 tokens) on 4 rows, refilled as rows finish: with prompts
    riding in the decode steps every greedy answer is transformers', the answers of prefill
    programs. (Sampled answers: the conversations of the last test.)"""
    tcfg, *_, mesh = tiny
    model, w = chaotic
    ps = prompts()
    limits = [6 + (11 * i) % 31 for i in range(len(ps))]  # all within one window of 128
    engine, got = run(tcfg, w, mesh, ps, 4, limits, **MIXED)
    _, base = run(tcfg, w, mesh, ps, 4, limits)
    assert got == base
    for p, tokens in zip(ps, got, strict=True):
        at = greedy_divergence(model, p, tokens)
        assert at is None, f"prompt of {len(p)} tokens: leaves greedy decoding at token {at}"
    assert any(k[0] == "mixed" for k in engine.programs)
    # the first prompts were prefilled alone (no row decoded), the later ones rode along
    assert any(k[0] == "prefill" for k in engine.programs)
    assert engine.prefilled_tokens == sum(map(len, ps))


def test_a_mixed_step_equals_a_prefill_and_a_decode_step(tiny, chaotic):
    """One mixed step by hand: rows 0 and 1 decode their newest tokens while the 30-token
    prompt of row 2 rides as pieces of 8 (all four in the step, each reading the ones
    before it). Its logits are those of a decode step of the two rows and a prefill of the
    prompt, run apart, and its cache holds the same keys."""
    tcfg, *_, mesh = tiny
    _, w = chaotic
    w = target.unstack(w, tcfg)
    engine = Engine(tcfg, w, mesh, [], EngineConfig(rows=4, max_context=64, sync_every=4,
                                                    prefill_chunk=32))
    live = prompts((11, 19), seed=5)
    engine.step(collections.deque(Request(i, p, 9, i) for i, p in enumerate(live)))
    state, cache = engine.state, engine.cache
    assert list(np.asarray(state.active)) == [True, True, False, False]
    prompt = prompts((30,), seed=6)[0]
    t, g = 8, 4
    tokens = np.zeros((g, t), np.int32)
    for k in range(g):
        piece = prompt[k * t: (k + 1) * t]
        tokens[k, : len(piece)] = piece
    # row 2 is idle in the decode group: its write goes to the prompt's end
    idle = dataclasses.replace(state, position=state.position.at[2].set(len(prompt)))
    rows, starts = jnp.full((g,), 2, jnp.int32), jnp.arange(g, dtype=jnp.int32) * t
    hidden_a, hidden_b, mixed_cache = jax.jit(mixed.forward, static_argnums=1,
                                              static_argnames=("window", "rows_impl"))(
        w, tcfg, idle, jnp.asarray(tokens), rows, starts, cache, window=64, rows_impl="xla")

    o, decode_cache = row_cache.forward_rows(w, tcfg, idle.token[:, None],
                                          idle.position[:, None], cache, window=64)
    p, apart = row_cache.forward_rows(w, tcfg, jnp.asarray([prompt]),
                                   jnp.arange(len(prompt))[None], decode_cache,
                                   rows_B=jnp.asarray([2]), prefill=True)
    both = (logits(w, hidden_a[:2]), logits(w, hidden_b.reshape(g * t, -1)[:len(prompt)]))
    alone = (logits(w, o.hidden_BxTxD[:2, 0]), logits(w, p.hidden_BxTxD[0]))
    for x, y in zip(both, alone, strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-5, atol=1e-5)
        assert (np.asarray(x).argmax(-1) == np.asarray(y).argmax(-1)).all()
    n = len(prompt)
    for a, b in zip(mixed_cache.k + mixed_cache.v, apart.k + apart.v, strict=True):
        np.testing.assert_allclose(np.asarray(a[:2]), np.asarray(b[:2]), rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(np.asarray(a[2, :n]), np.asarray(b[2, :n]), rtol=1e-5,
                                   atol=1e-5)


def test_pieces_are_planned_in_order_within_the_budget():
    """First come first served, a prompt's pieces in order (several in one wave where they
    fit), at most the program's steps of waves; a prompt already partly in starts where it
    stopped."""
    req = [Request(i, list(range(1, n + 1)), 5, i) for i, n in enumerate((20, 5, 40))]
    p = mixed.plan({3: (req[0], 4), 0: (req[1], 0), 1: (req[2], 0)}, c=4, g=3, t=8, steps=2)
    assert p.pieces == [[(3, 4), (3, 12), (0, 0)], [(1, 0), (1, 8), (1, 16)]]
    assert int(p.waves.count) == 2 and list(p.prefilling) == [5, 40, -1, 20]
    assert list(p.waves.tokens[0, 1]) == list(range(13, 21))
    assert list(p.waves.tokens[0, 2]) == [1, 2, 3, 4, 5, 0, 0, 0]
    assert list(p.waves.rows[1]) == [1, 1, 1]


def test_turns_and_samples_that_reuse_rows_ride_in_decode_steps_as_from_scratch(tiny, chaotic):
    """test_prefixes' conversations (5 x 3 turns, 2 sampled answers each, on 4 rows; answers
    of different lengths, so rows finish apart) with their prompts riding in decode steps: later turns extend their rows, a sample waits for
    its sibling's prompt to be in and copies its row; every answer is the one of prefilling
    every prompt whole by prefill programs."""
    from tests.decode.test_prefixes import Chat, conversations, regenerate

    tcfg, *_, mesh = tiny
    _, w = chaotic
    users = conversations(5)
    sampling = Sampling(temperature=0.9, top_p=0.95)

    def chats():
        return [Chat(c, k, u) for c, u in enumerate(users) for k in range(2)]

    scratch, shared = chats(), chats()
    base = regenerate(tcfg, w, mesh, scratch, False, sampling, stagger=True)
    engine = regenerate(tcfg, w, mesh, shared, True, sampling, stagger=True, **MIXED)
    assert [c.answers for c in shared] == [c.answers for c in scratch]
    assert any(k[0] == "mixed" for k in engine.programs)
    assert ("copy", engine.prefill_batch) in engine.programs
    assert engine.prefilled_tokens + engine.reused_tokens == base.prefilled_tokens


def test_mixed_steps_through_the_ragged_kernel_stay_greedy(tiny, chaotic):
    """EngineConfig(attention="pallas"), the GPU's path (interpret mode here): both token
    groups of a mixed step read the cache through the kernel (the pieces as rows of their
    own, several per prompt); the answers stay transformers' greedy tokens."""
    tcfg, *_, mesh = tiny
    model, w = chaotic
    ps = prompts((9, 40, 21), seed=7)
    limits = [6, 12, 8]
    engine, got = run(tcfg, w, mesh, ps, 2, limits, attention="pallas", **MIXED)
    assert any(k[0] == "mixed" for k in engine.programs)
    for p, tokens in zip(ps, got, strict=True):
        assert len(tokens) == limits[ps.index(p)]
        at = greedy_divergence(model, p, tokens)
        assert at is None, f"prompt of {len(p)} tokens: leaves greedy decoding at token {at}"
