"""`eval --prompts` with a parallel drafter (P-EAGLE, DFlash: decode/parallel_draft.py) trained
by `train` on the tiny target: real speculative decoding through the one engine, one draft
pass and one verify a round, at batch 1 and at --concurrency 2 (three answers on two rows:
refill), fp32 greedy identical to plain decoding, tau reported as the chain's, and sampled
(--temperature) the same way; the drafting shapes a block cannot give, refused in one line
with nothing written."""

from __future__ import annotations

import json

import pytest

from tests import assets
from tests.cli.test_eval import FP32, GENERATE, invoke

# each the training run of test_train_peagle / test_train_dflash (the schedule is no longer
# compiled into the step, but the same steps keep the runs alike): the session compiles the
# train program once
TRAIN = {"peagle": ["--arch", "peagle", "--ttt-length", "3"],
         "dflash": ["--arch", "dflash", "--block-size", "4", "--draft-layers", "2",
                    "--epochs", "1", "--lr", "1e-3"]}


@pytest.fixture(scope="module", params=sorted(TRAIN))
def run(request, tmp_path_factory):
    """(assets dir, the trained draft, its method)."""
    a = assets.train_assets()
    out = tmp_path_factory.mktemp(request.param) / "run"
    r = invoke(["train", "--target", a / "target", "--data", a / "train.jsonl", "--vocab",
                a / "vocab.safetensors", "--out", out, "--seq-len", "128", "--batch-size", "2",
                "--max-steps", "2", "--mesh", "data=1,tensor=1", *FP32, *TRAIN[request.param]])
    assert r.exit_code == 0, r.output
    return a, out / "final", request.param


def prompts_file(tmp_path):
    p = tmp_path / "prompts.jsonl"
    p.write_text("".join(json.dumps({"id": f"q{i}", "turns": [text]}) + "\n" for i, text in
                         enumerate(["Name a color.", "Count to three.", "Say hi."])))
    return p


def gen(a, draft, prompts, *extra):
    return invoke(["eval", "--target", a / "target", "--draft", draft, "--prompts", prompts,
                   "--max-new-tokens", 12, *FP32, *extra])


def test_decodes_losslessly_and_reports_tau_at_batch_1_and_with_refill(run, tmp_path):
    a, draft, _ = run
    samples = tmp_path / "samples.jsonl"
    r = gen(a, draft, prompts_file(tmp_path), "--concurrency", "2", "--samples", samples,
            "--json")
    assert r.exit_code == 0, r.output
    result = json.loads(r.stdout)
    assert GENERATE <= result.keys() and result["steps"] == 3  # the block's 3 proposals
    assert result["identical_to_baseline"] == result["prompts"] == 3
    records = [json.loads(line) for line in samples.read_text().splitlines()]
    steps = [x for s in records for x in s["accept_lengths"]]
    assert steps and all(0 <= x <= 3 for x in steps)
    assert result["tau_pooled"] == pytest.approx(sum(x + 1 for x in steps) / len(steps))
    assert len(result["accept_rate"]) == 3 and result["verify_steps"] == len(steps)
    (two,) = result["concurrency"]
    assert two["batch"] == 2 and two["identical_to_baseline"] == 3 and two["tau_pooled"] >= 1


def test_samples_and_reports_tau_at_batch_1_and_with_refill(run, tmp_path):
    """--temperature 0.8: speculative sampling with the block (that it gives the target's
    distribution: tests/decode/test_parallel_draft.py); tau from the answers' accepted
    counts, no identity with plain decoding claimed (sampled answers differ by chance)."""
    a, draft, _ = run
    samples = tmp_path / "samples.jsonl"
    r = gen(a, draft, prompts_file(tmp_path), "--temperature", "0.8", "--concurrency", "2",
            "--samples", samples, "--json")
    assert r.exit_code == 0, r.output
    result = json.loads(r.stdout)
    assert GENERATE <= result.keys() and (result["steps"], result["temperature"]) == (3, 0.8)
    assert result["identical_to_baseline"] is None and result["prompts"] == 3
    records = [json.loads(line) for line in samples.read_text().splitlines()]
    steps = [x for s in records for x in s["accept_lengths"]]
    assert steps and all(0 <= x <= 3 for x in steps)
    assert result["tau_pooled"] == pytest.approx(sum(x + 1 for x in steps) / len(steps))
    (two,) = result["concurrency"]
    assert two["batch"] == 2 and two["identical_to_baseline"] is None and two["tau_pooled"] >= 1


@pytest.mark.parametrize("extra, message", [
    (["--steps", "4"], "proposes 3 tokens a pass, not 4"),
    (["--steps", "4", "--temperature", "0.8"], "proposes 3 tokens a pass, not 4"),
    (["--topk", "2", "--draft-tokens", "4"], "proposes one block, not a tree"),
    (["--sweep"], "proposes one block (measure it with --concurrency)"),
])
def test_shapes_a_block_cannot_give_are_one_line(run, tmp_path, extra, message):
    a, draft, _ = run
    samples = tmp_path / "samples.jsonl"
    r = gen(a, draft, prompts_file(tmp_path), "--samples", samples, *extra)
    lines = r.output.strip().splitlines()
    assert r.exit_code == 2 and lines[-1].startswith("error: ") and message in lines[-1], r.output
    assert not samples.exists()


def test_a_block_past_the_context_is_refused_before_anything_is_written(run, tmp_path):
    """The tiny target's context is 256: a prompt and answer that fit it leave no room for
    the block one verify writes after the answer's last token."""
    a, draft, _ = run
    tok = assets.smollm2_tokenizer()
    length = len(tok.apply_chat_template([{"role": "user", "content": "Say hi."}],
                                         add_generation_prompt=True, tokenize=True,
                                         return_dict=False))
    prompts = tmp_path / "one.jsonl"
    prompts.write_text(json.dumps({"id": "hi", "turns": ["Say hi."]}) + "\n")
    samples = tmp_path / "samples.jsonl"
    r = invoke(["eval", "--target", a / "target", "--draft", draft, "--prompts", prompts,
                "--max-new-tokens", 256 - length - 1, "--samples", samples, *FP32])
    lines = r.output.strip().splitlines()
    assert r.exit_code == 2 and lines[-1] == (
        f"error: one.jsonl: conversation 'hi' turn 1: {length} prompt tokens + "
        f"--max-new-tokens {256 - length - 1} + one verify's 4 draft tokens exceed the "
        "target's context of 256 tokens; shorten the prompt, lower --max-new-tokens or the "
        "draft's block (--steps)"), r.output
    assert not samples.exists()
