"""The eval job's checks: drafts in every format load to the same weights, drafts made for
another target or tokenizer are refused, stop tokens, and the generation mesh."""

from __future__ import annotations

import collections
import dataclasses
import shutil

import jax
import numpy as np
import pytest

from eagle3kit.core.config import DraftConfig
from eagle3kit.core.draft import DraftWeights
from eagle3kit.core.draft import arrays as draft_arrays
from eagle3kit.core.sharding import init_weights
from eagle3kit.errors import MismatchError, UserError
from eagle3kit.formats import export_draft
from eagle3kit.io.draft_io import Draft, load_draft, read_vocab, save_draft
from eagle3kit.io.hf import resolve_target
from eagle3kit.jobs.common import load_draft_for_target
from eagle3kit.jobs.evaluate import generation_mesh, stop_ids
from tests import assets


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """The tiny target with SmolLM2's tokenizer, its data, and a random draft in eagle3kit's
    format plus its SGLang (without the provenance sidecar) and speculators exports."""
    a = assets.train_assets()
    ckpt = resolve_target(a / "target")
    vocab, meta = read_vocab(a / "vocab.safetensors")
    cfg = DraftConfig.for_target(ckpt.config, vocab.draft_size)
    w = jax.tree.map(np.asarray, init_weights(DraftWeights.abstract(cfg), jax.random.key(5)))
    root = tmp_path_factory.mktemp("formats")
    draft = Draft(cfg, w, vocab, str(a / "target"), ckpt.hf_config,
                  {"tokenizer": meta["tokenizer"]})
    save_draft(root / "eagle3kit", draft)
    export_draft(draft, "sglang", root / "sglang", dtype="float32")
    (root / "sglang" / "eagle3kit.json").unlink()  # as SpecForge writes it: no target record
    export_draft(draft, "speculators", root / "speculators", dtype="float32")
    return a, ckpt, root, draft


def test_every_format_loads_to_the_same_draft(tiny):
    a, ckpt, root, draft = tiny
    for fmt in ("eagle3kit", "sglang", "speculators"):
        got = load_draft_for_target(str(root / fmt), str(a / "target"), ckpt, None)
        assert got.config.aux_layer_ids == draft.config.aux_layer_ids, fmt
        for name in draft_arrays(draft.weights):
            np.testing.assert_array_equal(getattr(got.weights, name),
                                          getattr(draft.weights, name), err_msg=fmt)
        np.testing.assert_array_equal(got.vocab.d2t, draft.vocab.d2t)


def test_a_draft_recorded_for_another_architecture_is_refused(tiny, tmp_path):
    a, ckpt, root, _ = tiny
    d = load_draft(root / "eagle3kit")
    d.target_config = {**d.target_config, "num_hidden_layers": 12}
    save_draft(tmp_path / "d", d)
    with pytest.raises(MismatchError, match=r"trained for .* \(num_layers 12\), but .* has 8"):
        load_draft_for_target(str(tmp_path / "d"), str(a / "target"), ckpt, None)


def test_a_draft_from_another_tokenizer_is_refused(tiny):
    a, ckpt, root, draft = tiny
    with pytest.raises(MismatchError, match="tokenizer"):
        load_draft_for_target(str(root / "eagle3kit"), str(a / "target"), ckpt, "49152:" + "f" * 16)


def test_a_foreign_export_without_its_target_is_checked_against_ours(tiny, tmp_path):
    """An SGLang export records no target: it is read with ours, and a misfit still fails."""
    _, _, root, _ = tiny
    other = tmp_path / "other"
    assets.tiny_hf_model("qwen2", other)  # hidden 32, vocab 96
    shutil.copytree(root / "sglang", tmp_path / "sglang")
    with pytest.raises(MismatchError, match="does not fit the target"):
        load_draft_for_target(str(tmp_path / "sglang"), str(other), resolve_target(other), None)


def test_stop_ids_join_the_tokenizer_and_the_config(tiny):
    a, ckpt, _, _ = tiny
    tok = assets.smollm2_tokenizer()
    assert stop_ids(tok, ckpt) == [2]  # <|im_end|>
    ckpt.source.config["eos_token_id"] = [0, 7]
    try:
        assert stop_ids(tok, ckpt) == [0, 2, 7]
    finally:
        ckpt.source.config["eos_token_id"] = 2


def test_stop_ids_add_the_templates_end_of_turn(tiny):
    """A base model's config knows only <eos>; with Gemma's turn format an answer ends at
    <end_of_turn>, the token the template closes a model turn with."""
    from eagle3kit.data.chat import Renderer
    from eagle3kit.data.tokenizer import KNOWN_TEMPLATES
    from eagle3kit.jobs.evaluate import end_of_turn
    from tests.data import chat_tokenizers

    _, ckpt, _, _ = tiny
    tok = chat_tokenizers.gemma3()
    renderer = Renderer(tok, chat_template=KNOWN_TEMPLATES["gemma"])
    assert end_of_turn(renderer) == "<end_of_turn>"
    closing = tok.convert_tokens_to_ids("<end_of_turn>")
    assert stop_ids(tok, ckpt, renderer) == sorted({tok.eos_token_id, 2, closing})
    smol = assets.smollm2_tokenizer()  # ChatML: <|im_end|> is eos already
    assert stop_ids(smol, ckpt, Renderer(smol)) == [2]


def testgeneration_mesh():
    assert dict(generation_mesh(None).shape) == {"data": 1, "tensor": 1}
    assert dict(generation_mesh("tensor=2").shape) == {"data": 1, "tensor": 2}
    with pytest.raises(UserError, match="data must be 1"):
        generation_mesh("data=2,tensor=1")
    with pytest.raises(UserError, match="bad --mesh"):
        generation_mesh("tensor=two")


def _one_row_eval(tiny, tmp_path, turns: dict[str, list[str]], steps: int, max_new: int):
    """generate_samples on the tiny target in float32 over the prompt set `turns`
    (conversation id -> user turns): (setup(draft), answer(setup, timed=True))."""
    import json

    import jax.numpy as jnp
    from rich.console import Console

    from eagle3kit.core import draft as draft_lib
    from eagle3kit.core import target
    from eagle3kit.core.vocab_arrays import VocabArrays
    from eagle3kit.data.prompts import load_prompts
    from eagle3kit.data.tokenizer import load_tokenizer
    from eagle3kit.decode.speculative import Speculation
    from eagle3kit.io.hf import load_target
    from eagle3kit.jobs import eval_batched
    from eagle3kit.jobs.evaluate import EvalConfig, decode_config, generate_samples

    a, ckpt, _, _ = tiny
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": i, "turns": t}) + "\n"
                               for i, t in turns.items()))
    tokenizer = load_tokenizer(str(a / "target"))
    mesh = generation_mesh(None)
    target_w = target.unstack_in_place(load_target(ckpt, mesh, jnp.float32), ckpt.config)
    cfg = EvalConfig(target=str(a / "target"), draft="d", prompts=str(prompts), steps=steps,
                     max_new_tokens=max_new, target_dtype="float32")
    console = Console(stderr=True, quiet=True)

    def setup(draft):
        return eval_batched.Setup(ckpt.config, target_w, mesh, stop_ids(tokenizer, ckpt),
                                  Speculation(draft.config, draft_lib.cast(
                                      jax.tree.map(jnp.asarray, draft.weights), jnp.float32),
                                      VocabArrays.from_map(draft.vocab), decode_config(cfg)))

    def answer(setup, timed: bool = True):
        return generate_samples(setup, load_prompts(str(prompts)), tokenizer, cfg, console,
                                timed=timed)

    return setup, answer


def test_acceptance_alone_is_what_the_timed_run_measures(tiny, tmp_path):
    """generate_samples(timed=False) (decode_speed.py --tau-only, tau on a CPU) answers the
    same turns with the same accepted lengths as the timed run, and claims no speed."""
    from eagle3kit.core.vocab import VocabMap

    _, ckpt, _, random_draft = tiny
    setup, answer = _one_row_eval(tiny, tmp_path, {"c": ["Name a color.", "Another?"],
                                                   "d": ["Count to three."]}, 3, 24)
    # a draft that always proposes the target's most frequent greedy token m (draft index 0
    # of a vocab starting at m, all logits 0): accepted wherever the target repeats m
    _, first = answer(setup(random_draft), timed=False)
    m = int(np.bincount([t for s in first for t in s.generated_ids]).argmax())
    w = jax.tree.map(np.asarray, random_draft.weights)
    w.final_norm = np.zeros_like(w.final_norm)
    draft = Draft(random_draft.config, w, VocabMap.from_ids(
        np.arange(m, m + random_draft.config.draft_vocab_size), ckpt.config.vocab_size),
        "tiny", ckpt.hf_config, {})
    setup = setup(draft)
    timed, timed_samples = answer(setup)
    alone, samples = answer(setup, timed=False)
    assert [(s.id, s.turn, s.generated_ids, s.accept_lengths) for s in samples] == \
        [(s.id, s.turn, s.generated_ids, s.accept_lengths) for s in timed_samples]
    # every acceptance figure (tau, verify steps, tokens) is the timed run's, nothing more
    assert len(samples) == 3 and alone["tau_pooled"] > 1
    assert alone == {k: timed[k] for k in alone}
    assert "speedup" in timed and not {"speedup", "tokens_per_s_speculative"} & alone.keys()


def test_timed_call_says_when_jax_compiled():
    from eagle3kit.jobs.eval_batched import timed_call

    f = jax.jit(lambda x: x * 2 + 1)
    x3, x4 = np.arange(3.0), np.arange(4.0)
    assert timed_call(lambda: f(x3))[2] is True  # traced and compiled
    assert timed_call(lambda: f(x3))[2] is False  # the same shape again
    assert timed_call(lambda: f(x4))[2] is True  # a new shape
    out, seconds, _ = timed_call(lambda: f(x4))
    assert seconds > 0 and np.array_equal(out, x4 * 2 + 1)


def test_a_timed_run_times_again_only_the_answers_that_compiled(tiny, tmp_path):
    """Each answer is timed alone; one during which JAX compiled is run again and timed
    again. A second timed run of the same prompts meets only compiled shapes: it runs no
    answer twice, and it measures the same answers."""
    setup, answer = _one_row_eval(tiny, tmp_path, {"c": ["Name a color.", "Another?"]}, 2, 8)
    setup = setup(tiny[3])
    jax.clear_caches()  # what other tests of this process compiled is compiled again
    (first, first_samples), (second, second_samples) = answer(setup), answer(setup)
    assert first["retimed_answers"] >= 2  # the first speculative and plain answers compiled
    assert second["retimed_answers"] == 0
    assert [s.generated_ids for s in first_samples] == [s.generated_ids for s in second_samples]
    assert all(s.seconds > 0 and s.baseline_seconds > 0 for s in second_samples)
    assert second["identical_to_baseline"] == 2  # float32: lossless


def test_batched_programs_check_every_eight_steps_and_one_row_every_step(tiny, tmp_path):
    """eval's engines (batch 1 and every --concurrency): several rows check whether to end
    only every 8 steps (measured faster on a GPU), one row every step (its program ends as it
    finishes); the cache attention `auto` resolves for the devices (the XLA path on a CPU)."""
    from eagle3kit.jobs import eval_batched

    setup, _ = _one_row_eval(tiny, tmp_path, {"c": ["Name a color."]}, 3, 8)
    setup = setup(tiny[3])
    dec = setup.draft.dec
    for rows, spec, every in ((8, dec, 8), (32, None, 8), (1, dec, 1), (1, None, 1)):
        engine = setup.engine(rows, 256, spec)
        assert (engine.cfg.check_every, engine.cfg.attention) == (every, "xla")
        assert engine.cfg.check_every == (eval_batched.BATCHED_CHECK_EVERY if rows > 1 else 1)
    setup.check_every, setup.kv_attention = 2, "xla"  # decode_speed.py --check-every 2
    assert setup.engine(8, 256, dec).cfg.check_every == 2


def test_a_run_compiles_each_program_once_though_later_turns_need_a_larger_cache(
        tiny, tmp_path, monkeypatch):
    """Turn 2's prompt holds turn 1's answer and needs twice turn 1's cache: every engine of
    the run has the one cache size, so each device program compiles once a run (an engine
    on the smallest cache each prompt fits compiled the same steps again per cache size),
    and a second run, with new engines, compiles nothing."""
    from eagle3kit.jobs import eval_batched

    long = " ".join(["Name one more color, please."] * 40)  # turn 2 alone needs 512 slots
    setup, answer = _one_row_eval(tiny, tmp_path, {"c": ["Name a color.", long]}, 2, 8)
    setup = setup(tiny[3])
    # positions for both turns (the tiny target's 256 hold one turn and its answer)
    setup = dataclasses.replace(setup, tcfg=dataclasses.replace(setup.tcfg,
                                                                max_position_embeddings=1024))
    engines, compiled = [], collections.Counter()
    make = eval_batched.Setup.engine
    monkeypatch.setattr(eval_batched.Setup, "engine", lambda self, *a: engines.append(
        make(self, *a)) or engines[-1])

    def count(event: str, duration: float, fun_name: str = "", **_) -> None:
        if event == "/jax/core/compile/backend_compile_duration":
            compiled[fun_name] += 1

    jax.monitoring.register_event_duration_secs_listener(count)
    jax.clear_caches()  # what other tests of this process compiled is compiled again
    first, samples = answer(setup)
    lengths = [len(s.prompt_ids) for s in samples]
    assert [eval_batched.slots_for_length(n, 8, [setup.draft.dec]) for n in lengths] == [
        256, 512]  # the smallest caches the two turns fit
    # one speculative and one plain engine (their programs differ), on one cache
    assert {e.cfg.max_context for e in engines} == {512} and len(engines) == 2
    for kind in ("prefill", "decode", "verify"):
        shapes = sum(p[0] == kind for e in engines for p in e.programs)
        assert compiled[f"jit(_{kind})"] == shapes > 0, (kind, compiled)
    assert first["compiled_programs"] == sum(compiled.values())
    assert first["compile_s"] > 0 and first["untimed_s"] >= first["compile_s"]
    compiled.clear()
    second, _ = answer(setup)
    assert second["compiled_programs"] == 0 and not compiled and second["compile_s"] == 0
