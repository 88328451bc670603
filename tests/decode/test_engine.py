"""The batched generation engine: exact greedy decoding against transformers' `generate`
(also where a program crosses a window boundary, on a target whose answers depend on every
key), independence from the batch (rows, refill order), stop tokens and limits, sampling
rules and fresh randomness at every token.

fp32 with the highest matmul precision throughout (tests/conftest.py): greedy tokens must
then equal transformers' token for token; a wrong position, cache row or mask changes them
within a few tokens.
"""

from __future__ import annotations

import collections
import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from eagle3kit.core.sharding import make_mesh
from eagle3kit.decode.engine import (
    Engine,
    EngineConfig,
    Request,
    Sampling,
    auto_kv_attention,
    sample,
)
from eagle3kit.decode.repetition import Repetition
from eagle3kit.io.hf import load_target, resolve_target
from tests import assets
from tests.decode.hf_reference import greedy_divergence, repeat_zscores

NEW = 64
LENGTHS = (5, 17, 40, 9, 33, 70, 3, 21)  # across the prefill chunk of 32 used below


def _tiny(family, directory):
    """(family, torch model, checkpoint, fp32 weights on one device, mesh, prompts)."""
    model = assets.tiny_hf_model(family, directory)
    ckpt = resolve_target(directory)
    mesh = make_mesh("data=1,tensor=1", jax.devices()[:1])
    rng = np.random.default_rng(0)
    prompts = [[int(x) for x in rng.integers(0, 96, n)] for n in LENGTHS]
    return family, model, ckpt, load_target(ckpt, mesh, jnp.float32), mesh, prompts


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return _tiny("llama", tmp_path_factory.mktemp("llama"))


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    return _tiny("qwen3", tmp_path_factory.mktemp("qwen3"))


@pytest.fixture(params=["llama", "qwen3"])
def tiny(request):
    return request.getfixturevalue(request.param)


def run(ckpt, w, mesh, prompts, rows, new=NEW, stops=(), sampling=Sampling(), limits=None,
        seeds=None, sync_every=8, repetition=None, attention="xla"):
    cfg = EngineConfig(rows=rows, max_context=256, sync_every=sync_every, prefill_chunk=32,
                       sampling=sampling, repetition=repetition, attention=attention)
    engine = Engine(ckpt.config, w, mesh, list(stops), cfg)
    limits = limits or [new] * len(prompts)
    seeds = seeds or list(range(len(prompts)))
    return engine.generate([Request(i, p, n, s) for i, (p, n, s) in
                            enumerate(zip(prompts, limits, seeds, strict=True))])


def test_greedy_equals_transformers_generate(tiny):
    """Several prompts of different lengths (some prefilled in pieces) share 4 rows; every
    token is transformers' greedy one, checked in one forward per prompt (greedy_divergence;
    `generate` runs one per token)."""
    family, model, ckpt, w, mesh, prompts = tiny
    got = run(ckpt, w, mesh, prompts, rows=4)
    for p, c in zip(prompts, got, strict=True):
        assert len(c.tokens) == NEW and c.finish_reason == "length" and c.prompt_len == len(p)
        at = greedy_divergence(model, p, c.tokens)
        assert at is None, f"{family}, prompt of {len(p)} tokens: leaves greedy at token {at}"


REFILL_SAMPLING = Sampling(temperature=0.8, top_p=0.9)


@pytest.fixture(scope="module")
def refill(llama):
    """12 sampled requests of different lengths (request i seeded i) on 6 rows, checked
    every step (`run`'s engine): (prompts, limits, completions, device steps run). Both
    tests below compare against this one run (it was run by each)."""
    _, _, ckpt, w, mesh, prompts = llama
    prompts = (prompts * 2)[:12]
    limits = [4 + (7 * i) % 29 for i in range(12)]  # most not multiples of 4
    engine = Engine(ckpt.config, w, mesh, [], EngineConfig(
        rows=6, max_context=256, sync_every=8, check_every=1, prefill_chunk=32,
        sampling=REFILL_SAMPLING))
    got = engine.generate([Request(i, p, n, i) for i, (p, n) in
                           enumerate(zip(prompts, limits, strict=True))])
    return prompts, limits, got, engine.device_steps


def test_one_row_and_sixteen_rows_with_refill_give_the_same_tokens(llama, refill):
    """12 requests of different lengths: with 6 rows they finish in another order and
    rows are refilled mid-flight; sampled tokens stay those of one row at a time (sampling
    streams belong to requests, not rows). Greedy rows sharing a batch with refill are
    test_greedy_equals_transformers_generate's (8 prompts on 4 rows)."""
    family, model, ckpt, w, mesh, _ = llama
    prompts, limits, many, _ = refill
    sampling = REFILL_SAMPLING
    one = run(ckpt, w, mesh, prompts, rows=1, sampling=sampling, limits=limits)
    assert [c.tokens for c in many] == [c.tokens for c in one], family
    assert [len(c.tokens) for c in one] == limits
    # same request seed, same answer; another seed, another answer (on the 6 rows above:
    # their compiled programs)
    a = run(ckpt, w, mesh, prompts[:2], rows=6, sampling=sampling, seeds=[5, 5])
    b = run(ckpt, w, mesh, prompts[:2], rows=6, sampling=sampling, seeds=[6, 6])
    assert a[0].tokens != b[0].tokens


def test_programs_that_check_every_four_steps_give_the_same_tokens(llama, refill):
    """EngineConfig(check_every=4): a decode program decides whether to end early only every
    4 steps (a loop of fixed count between, which a GPU runs without reading the condition
    back). Rows that reach their limit mid-way idle through the rest of the 4 (their tokens
    are not emitted) and are refilled after: every request's sampled tokens are those of
    check_every=1, and every program ran a multiple of 4 steps."""
    family, model, ckpt, w, mesh, _ = llama
    prompts, limits, every_step, every_step_ran = refill  # check_every=1
    requests = [Request(i, p, n, i) for i, (p, n) in enumerate(zip(prompts, limits, strict=True))]
    got, ran = {1: every_step}, {1: every_step_ran}
    engine = Engine(ckpt.config, w, mesh, [], EngineConfig(
        rows=6, max_context=256, sync_every=8, check_every=4, prefill_chunk=32,
        sampling=REFILL_SAMPLING))
    got[4] = engine.generate(requests)
    ran[4] = engine.device_steps
    assert [c.tokens for c in got[4]] == [c.tokens for c in got[1]]
    assert [len(c.tokens) for c in got[4]] == limits
    assert ran[4] % 4 == 0 and ran[1] % 4  # (checking every step ended some programs early)
    # the 4 steps between checks are a loop XLA knows the count of (a GPU runs such a loop
    # without reading its condition back; the sampler's own loops have 5)
    text = engine._step.lower(
        engine.w, None, None, engine.cache, engine.dcache, engine.state, engine.base_key,
        engine.stop_ids, jnp.int32(0), steps=8, window=128).compile().as_text()
    assert "4" in re.findall(r'"known_trip_count":\{"n":"(\d+)"\}', text)
    with pytest.raises(ValueError, match="check_every 3: a divisor of sync_every"):
        Engine(ckpt.config, w, mesh, [], EngineConfig(rows=6, max_context=256, sync_every=8,
                                                      check_every=3))


def test_programs_end_for_refills_once_a_share_of_the_rows_finished(llama, refill):
    """EngineConfig(refill_share=2) on 6 rows: a program ends early for the queued requests
    once 3 of its rows have finished, not at the first (each end is a host sync, the
    collecting and refilling, and a new launch). Finished rows idle until then and are
    refilled after: every request's sampled tokens are those of ending at the first finished
    row, in fewer programs; with fewer queued requests than 3 it ends for as many as wait."""
    family, model, ckpt, w, mesh, _ = llama
    prompts, limits, at_first, _ = refill  # rows // 16 = 0: a program ends at the first
    requests = [Request(i, p, n, i) for i, (p, n) in enumerate(zip(prompts, limits, strict=True))]
    ends = {}
    for share in (16, 2):
        engine = Engine(ckpt.config, w, mesh, [], EngineConfig(
            rows=6, max_context=256, sync_every=8, prefill_chunk=32, refill_share=share,
            sampling=REFILL_SAMPLING))
        got = engine.generate(requests)
        assert [c.tokens for c in got] == [c.tokens for c in at_first], share
        ends[share] = engine.step_programs
        assert [engine._refill_at(q) for q in (0, 1, 2, 5)] == (
            [0, 1, 1, 1] if share == 16 else [0, 1, 2, 3])
    assert ends[2] < ends[16], ends


def test_a_row_the_device_ended_but_the_host_waits_on_is_an_error_not_a_hang(llama):
    """The host retires a row when the tokens it collected end it, and the device ends the
    row by the same rule. Should the two disagree (a wrong step index inside a multi-step
    program loses tokens, so the device counts a row finished that the host does not), the
    engine says so at the next program: it used to loop forever on a row no program would
    advance again. (The shapes of test_greedy_equals_transformers_generate.)"""
    family, model, ckpt, w, mesh, prompts = llama
    engine = Engine(ckpt.config, w, mesh, [], EngineConfig(rows=4, max_context=256,
                                                           sync_every=8, prefill_chunk=32))
    queue = collections.deque([Request(0, prompts[0], NEW)])
    assert engine.step(queue) == [] and engine.busy  # a prefill and a program of 8 steps
    assert engine.device_steps == 8
    engine.state = dataclasses.replace(engine.state, active=jnp.zeros_like(engine.state.active))
    with pytest.raises(RuntimeError, match=r"rows \[0\] emitted no token .* disagree"):
        engine.step(queue)  # (one program: `generate` would loop on it)


def test_prefill_programs_have_the_same_rows_however_many_prompts_arrive(llama):
    """A prompt's prefill must not take its shape from its neighbours: a matmul's rounding
    depends on its shape, and on a GPU in bf16 a near-tie then turns a greedy answer (4 x H100:
    85 of 242 answers of four --shard processes differed from one process's). Twelve prompts
    admitted at once into 32 rows, and one at a time: every prefill program has the engine's
    P = C/16 rows, and the answers are the same."""
    family, model, ckpt, w, mesh, prompts = llama
    prompts = (prompts * 2)[:12]
    cfg = EngineConfig(rows=32, max_context=256, sync_every=4, prefill_chunk=32)
    engine = Engine(ckpt.config, w, mesh, [], cfg)
    got = engine.generate([Request(i, p, 4, i) for i, p in enumerate(prompts)])
    assert engine.prefill_batch == 2
    assert {p[1] for p in engine.programs if p[0] == "prefill"} == {2}
    alone = [run(ckpt, w, mesh, [p], rows=32, new=4)[0].tokens for p in prompts[:3]]
    assert [c.tokens for c in got[:3]] == alone


def test_rows_crossing_a_window_boundary_mid_program_read_every_key(llama, chaotic):
    """Attention reads a window of the cache sized to the longest row; the first decode
    program of the 126-token prompt (8 steps) writes its keys at slots 126..133, six past
    the 128 a window of one step would read (the prefill's first token is the 127th), and
    its queries must read them. On the context-sensitive tiny Llama (`chaotic`)
    any key left out changes the greedy answer: it must stay transformers' token for token.
    (The shapes of test_greedy_equals_transformers_generate: its programs are reused.)"""
    _, _, ckpt, _, mesh, _ = llama
    model, w = chaotic
    rng = np.random.default_rng(1)
    prompts = [[int(x) for x in rng.integers(0, 96, n)] for n in (126, 20)]
    got = run(ckpt, w, mesh, prompts, rows=4)
    for p, c in zip(prompts, got, strict=True):
        assert len(c.tokens) == NEW
        at = greedy_divergence(model, p, c.tokens)
        assert at is None, f"prompt of {len(p)} tokens: leaves greedy decoding at token {at}"


def test_the_ragged_kernel_reads_every_key_in_place(llama, chaotic):
    """EngineConfig(attention="pallas"): prefill pieces after the first and every decode step
    read the cache through decode/ragged_attention's kernel (interpret mode here), each row to
    its own length; on the context-sensitive tiny Llama the answers stay transformers'
    greedy tokens, rows of different lengths side by side."""
    _, _, ckpt, _, mesh, _ = llama
    model, w = chaotic
    rng = np.random.default_rng(2)
    prompts = [[int(x) for x in rng.integers(0, 96, n)] for n in (70, 9)]
    got = run(ckpt, w, mesh, prompts, rows=2, new=12, attention="pallas")
    for p, c in zip(prompts, got, strict=True):
        assert len(c.tokens) == 12
        at = greedy_divergence(model, p, c.tokens)
        assert at is None, f"prompt of {len(p)} tokens: leaves greedy decoding at token {at}"


def test_programs_compiled_ahead_serve_every_request_at_one_prefill_shape(llama, chaotic):
    """EngineConfig(one_prefill_shape=True), as `eval --prompts` runs its one row, on the GPU's
    path (the kernel, interpret mode here): every prompt piece is padded to prefill_chunk, so
    prompts of 70 and 9 tokens (pieces of 32) meet two prefill programs, first pieces and
    later ones (buckets compiled one per piece size); `Engine.compilers` compiles those and
    the step ahead, several at once, and the requests then compile nothing. The answers stay
    transformers' greedy tokens on the context-sensitive tiny Llama."""
    from eagle3kit.jobs.eval_batched import compile_ahead

    _, _, ckpt, _, mesh, _ = llama
    model, w = chaotic
    rng = np.random.default_rng(2)
    prompts = [[int(x) for x in rng.integers(0, 96, n)] for n in (70, 9)]
    engine = Engine(ckpt.config, w, mesh, [], EngineConfig(
        rows=1, max_context=256, sync_every=8, prefill_chunk=32, one_prefill_shape=True,
        attention="pallas"))
    compile_ahead(engine.compilers([len(p) for p in prompts]))
    assert sorted(engine.programs) == [("decode", 1, 8, 256), ("prefill", 1, 32, 0),
                                       ("prefill", 1, 32, 256)]
    before = len(_COMPILED)
    got = engine.generate([Request(i, p, 12) for i, p in enumerate(prompts)])
    assert _COMPILED[before:] == []
    assert len(engine.programs) == 3
    for p, c in zip(prompts, got, strict=True):
        assert len(c.tokens) == 12
        at = greedy_divergence(model, p, c.tokens)
        assert at is None, f"prompt of {len(p)} tokens: leaves greedy decoding at token {at}"


_COMPILED: list[str] = []  # every program XLA compiled in this process, by name
jax.monitoring.register_event_duration_secs_listener(
    lambda event, _, fun_name="", **__: _COMPILED.append(fun_name)
    if event == "/jax/core/compile/backend_compile_duration" else None)


def test_auto_reads_the_cache_with_the_kernel_on_one_gpu_only():
    """`regenerate --kv-attention auto`: the ragged kernel where it was measured faster (one
    GPU per process), the XLA path on a CPU, a TPU, or a mesh (the kernel reads one device)."""
    from types import SimpleNamespace

    gpu, tpu = SimpleNamespace(platform="gpu"), SimpleNamespace(platform="tpu")
    assert auto_kv_attention([gpu]) == "pallas"
    assert auto_kv_attention([gpu, gpu]) == auto_kv_attention([tpu]) == "xla"
    assert auto_kv_attention(jax.devices()[:1]) == "xla"  # this CPU


def test_sampled_streams_draw_fresh_randomness_at_every_token(llama):
    """Temperature 1 on the tiny Llama, whose next-token distributions are nearly flat: a
    token equals the one l places before it about as often as the model's probabilities say
    (hf_reference.repeat_zscores), for l = 1..8. A stream that reuses a key (the same draw
    twice) repeats its tokens far more often."""
    family, model, ckpt, w, mesh, prompts = llama
    short = [p for p in prompts if len(p) <= 32] * 4  # 20 streams on Sampling(1.0)'s programs
    got = run(ckpt, w, mesh, short, rows=2, new=24, sampling=Sampling(1.0),
              seeds=list(range(len(short))))
    z = repeat_zscores(model, short, [c.tokens for c in got], 1.0, range(1, 9))
    assert max(abs(v) for v in z.values()) < 5, z


def test_a_stop_token_ends_a_row_and_is_kept(llama):
    family, model, ckpt, w, mesh, prompts = llama
    free = run(ckpt, w, mesh, prompts[:3], rows=2)[0].tokens
    stop = next(t for t in free if t != free[0])
    got = run(ckpt, w, mesh, prompts[:3], rows=2, stops=[stop])
    assert got[0].tokens == free[: free.index(stop) + 1] and got[0].finish_reason == "stop"
    assert len(got[0].tokens) >= 2 and got[1].finish_reason in ("stop", "length")
    one = run(ckpt, w, mesh, prompts[:1], rows=1, limits=[1])[0]
    assert one.tokens == free[:1] and one.finish_reason == "length"


def test_a_loop_ends_at_the_token_that_completes_it_whatever_the_sync(llama):
    """The tiny model's greedy rows fall into loops. With a repetition rule each answer ends
    where the rule, checked after every token, says (finish reason "repetition"), whether
    the host syncs after every step or every 8; freed rows are refilled with the right
    tokens (8 prompts on 4 rows)."""
    family, model, ckpt, w, mesh, prompts = llama
    rule = Repetition(copies=3, min_tokens=16, max_block=6)
    free = run(ckpt, w, mesh, prompts, rows=4)
    want = [rule.first(c.tokens) for c in free]
    assert 3 <= sum(n is not None for n in want) < len(want) - 1, want
    for sync in (1, 8):
        got = run(ckpt, w, mesh, prompts, rows=4, sync_every=sync, repetition=rule)
        for c, f, n in zip(got, free, want, strict=True):
            assert c.tokens == f.tokens[:n], (sync, n)
            assert c.finish_reason == ("length" if n is None else "repetition")


def test_data_and_tensor_parallel_rows_give_the_same_tokens(llama):
    """Rows split over data=2 (and heads over tensor=2): the same greedy tokens."""
    family, model, ckpt, w, mesh, prompts = llama
    ref = [c.tokens for c in run(ckpt, w, mesh, prompts, rows=4, new=16)]
    split = make_mesh("data=2,tensor=2", jax.devices()[:4])
    w2 = load_target(ckpt, split, jnp.float32)
    assert w2.layers.q.sharding.spec[2] == "tensor"
    assert [c.tokens for c in run(ckpt, w2, split, prompts, rows=4, new=16)] == ref


@pytest.mark.parametrize("top_p,top_k,kept", [(0.8, 0, 5), (1.0, 4, 4), (0.9, 5, 4)])
def test_sample_follows_the_nucleus(top_p, top_k, kept):
    """Draws from `sample` match softmax(logits / T) renormalised over the top_k most
    probable tokens, then over the top-p nucleus of those (chi-square), and never leave
    them."""
    from scipy import stats

    logits = jnp.asarray(np.random.default_rng(3).normal(size=(1, 12)), jnp.float32)
    n, t = 40000, 1.5
    keys = jax.random.split(jax.random.key(0), n)
    draws = np.asarray(jax.jit(jax.vmap(
        lambda k: sample(logits, k[None], Sampling(t, top_p, top_k))[0]))(keys))
    p = np.asarray(jax.nn.softmax(logits[0] / t), np.float64)
    order = np.argsort(-p)[: top_k or None]
    ranked = p[order] / p[order].sum()
    keep = order if top_p == 1 else order[: np.searchsorted(np.cumsum(ranked), top_p) + 1]
    q = np.zeros_like(p)
    q[keep] = p[keep] / p[keep].sum()
    counts = np.bincount(draws, minlength=12)
    assert len(keep) == kept and counts[q == 0].sum() == 0
    chi2 = stats.chisquare(counts[keep], n * q[keep])
    assert chi2.pvalue > 1e-3, chi2
    greedy = sample(logits, jax.random.split(jax.random.key(0), 1), Sampling())
    assert int(greedy[0]) == int(np.argmax(p))


@pytest.mark.slow
def test_smollm2_greedy_equals_transformers_generate(smollm2_gguf, smollm2_torch):
    """The real SmolLM2 (fp32, dequantised GGUF), real chat prompts: 64 tokens each equal
    transformers' greedy `generate`, checked in one forward per prompt (greedy_divergence:
    `generate` on CPU costs a minute here). One prefill and one decode program (a real
    30-layer target compiles slowly on CPU; pieces, refill and growing windows are the tiny
    tests')."""
    from eagle3kit.data.chat import prompt_ids

    model = smollm2_torch
    tok = assets.smollm2_tokenizer()
    ckpt = resolve_target(smollm2_gguf)
    mesh = make_mesh("data=1,tensor=1", jax.devices()[:1])
    w = load_target(ckpt, mesh, jnp.float32)
    chats = assets.sharegpt_chats(3)
    prompts = [prompt_ids(tok, c.messages[:1]) for c in chats]
    got = Engine(ckpt.config, w, mesh, [], EngineConfig(rows=3, max_context=256,
                                                        sync_every=NEW)).generate(
        [Request(i, p, NEW) for i, p in enumerate(prompts)])
    for p, c in zip(prompts, got, strict=True):
        assert len(c.tokens) == NEW
        at = greedy_divergence(model, p, c.tokens)
        assert at is None, f"prompt of {len(p)} tokens: leaves greedy decoding at token {at}"


def test_the_ragged_kernel_decodes_every_length_with_one_program(llama):
    """The kernel reads each row in place to its own length, never a window: as rows grow
    past the 128 and 192 positions that bound the XLA path's window, plain decoding keeps
    one compiled step (one per window bucket recompiled the same program, a minute each for
    an 8B target)."""
    _, _, ckpt, w, mesh, _ = llama
    rng = np.random.default_rng(3)
    prompts = [[int(x) for x in rng.integers(0, 96, n)] for n in (100, 9)]
    cfg = EngineConfig(rows=2, max_context=256, sync_every=8, prefill_chunk=32,
                       attention="pallas")
    engine = Engine(ckpt.config, w, mesh, [], cfg)
    got = engine.generate([Request(i, p, 32) for i, p in enumerate(prompts)])
    assert [len(c.tokens) for c in got] == [32, 32]
    assert [p for p in engine.programs if p[0] == "decode"] == [("decode", 2, 8, 256)]


def test_a_decode_program_updates_the_cache_in_place(llama):
    """In the compiled decode program (32 steps in a while loop) nothing but the cache writes
    (a scatter of each row's new keys) and the loop's own plumbing makes an array of a
    layer's cache shape: no copy of the cache (its bytes bound the step on a GPU), whether
    per step or to keep the caller's, which the program is given to update (donated)."""

    _, _, ckpt, w, mesh, _ = llama
    cfg = ckpt.config
    engine = Engine(cfg, w, mesh, [], EngineConfig(rows=4, max_context=256, sync_every=32))
    text = engine._step.lower(
        engine.w, None, None, engine.cache, engine.dcache, engine.state, engine.base_key,
        engine.stop_ids, jnp.asarray(False), steps=32, window=128).compile().as_text()
    shape = f"f32[4,256,{cfg.num_kv_heads},{cfg.head_dim}]"
    makers = re.findall(rf"= {re.escape(shape)}\S* ([\w-]+)\((?:.*?calls=%?([\w.-]+))?", text)
    assert makers, text[:2000]
    plumbing = {"parameter", "get-tuple-element", "tuple", "bitcast", "while"}
    odd = [m for m in makers if m[0] not in plumbing
           and not (m[0] == "fusion" and "scatter" in m[1]) and m[0] != "scatter"]
    assert not odd, f"cache-sized arrays made by {odd}"
    assert len([m for m in makers if m[0] == "scatter" or "scatter" in m[1]]) >= \
        2 * cfg.num_layers  # each layer's keys and values, in place
