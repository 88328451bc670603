"""`eagle3kit train` through the CLI: a run end to end, exact resume, sharding, bad input.

The target is a tiny random Llama with SmolLM2's real tokenizer; the data are real ShareGPT
conversations rendered with SmolLM2's chat template (tests/assets.train_assets).
"""

from __future__ import annotations

import json
from pathlib import Path

import jax
import numpy as np
import pytest
from typer.testing import CliRunner

from eagle3kit.cli.app import app
from eagle3kit.core.draft import DraftWeights
from eagle3kit.core.sharding import init_weights
from eagle3kit.io.draft_io import load_draft
from tests import assets

runner = CliRunner()
MESH = "data=4,tensor=2"  # 8 simulated CPU devices (conftest)


def base_args(a: Path, out: Path, *extra: str) -> list[str]:
    return ["train", "--target", str(a / "target"), "--data", str(a / "train.jsonl"),
            "--vocab", str(a / "vocab.safetensors"), "--out", str(out), "--seq-len", "128",
            "--batch-size", "4", "--ttt-length", "3", "--epochs", "1", "--mesh", MESH,
            "--dtype", "float32", "--target-dtype", "float32", "--save-every", "2",
            "--lr", "1e-3", *extra]


def invoke(args):
    result = runner.invoke(app, args)
    if result.exception and not isinstance(result.exception, SystemExit):
        raise result.exception
    return result


def losses(run: Path) -> list[tuple[int, float]]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r["loss"]) for r in rows if not r.get("eval")]


@pytest.fixture(scope="module")
def a():
    return assets.train_assets()


def test_train_resume_equals_uninterrupted(a, tmp_path):
    whole = tmp_path / "whole"
    r = invoke(base_args(a, whole, "--max-steps", "4"))
    assert r.exit_code == 0, r.output
    first = tmp_path / "part"
    # interrupted by the wall-clock limit after step 1 (its compilation alone takes longer)
    r = invoke(base_args(a, first, "--max-steps", "4", "--time-limit", "1"))
    assert r.exit_code == 75 and "--resume" in r.output, r.output
    assert not (first / "final").exists()
    r = invoke(base_args(a, first, "--max-steps", "2", "--resume"))  # a capped run ...
    assert r.exit_code == 0, r.output
    r = invoke(base_args(a, first, "--max-steps", "4", "--resume"))  # ... continued
    assert r.exit_code == 0, r.output
    assert [s for s, _ in losses(whole)] == [1, 2, 3, 4]
    assert losses(first) == losses(whole)
    a_w, b_w = load_draft(whole / "final"), load_draft(first / "final")
    for name in a_w.weights.__dataclass_fields__:
        np.testing.assert_array_equal(getattr(a_w.weights, name), getattr(b_w.weights, name))
    final = load_draft(whole / "final")
    assert final.training["steps"] == 4 and final.vocab.target_size == 49152
    assert final.config.aux_layer_ids == (2, 4, 5)
    recorded = json.loads((whole / "config.json").read_text())
    assert set(recorded["fingerprints"]) == {"tokenizer", "data", "vocab", "target"}


def test_same_batch_on_one_device_and_on_a_mesh(a, tmp_path):
    """The same global batch on data=4,tensor=2 and on one device: same losses and update."""
    sharded, single = tmp_path / "sharded", tmp_path / "single"
    assert invoke(base_args(a, sharded, "--max-steps", "2")).exit_code == 0
    args = base_args(a, single, "--max-steps", "2")
    args[args.index(MESH)] = "data=1,tensor=1"
    assert invoke(args).exit_code == 0
    for (s1, l1), (s2, l2) in zip(losses(sharded), losses(single), strict=True):
        assert s1 == s2 and l1 == pytest.approx(l2, rel=1e-5)
    w1, w2 = load_draft(sharded / "final").weights, load_draft(single / "final").weights
    for name in w1.__dataclass_fields__:
        np.testing.assert_allclose(getattr(w1, name), getattr(w2, name), rtol=1e-4, atol=1e-6)


def rows(run: Path) -> list[dict]:
    return [r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
            if not r.get("eval")]


@pytest.fixture(scope="module")
def fp32_run(a, tmp_path_factory):
    """Two fp32 steps of 4 rows on one device: the baseline of the equivalences below."""
    out = tmp_path_factory.mktemp("fp32") / "run"
    assert invoke(base_args(a, out, *ONE_DEVICE)).exit_code == 0
    return out


ONE_DEVICE = ["--max-steps", "2", "--mesh", "data=1,tensor=1"]


def test_grad_accum_equals_twice_the_rows(a, fp32_run, tmp_path):
    """`--batch-size 2 --grad-accum 2` and `--batch-size 4` see the same 4 rows per step
    (denominators over the whole global batch): same loss, grad_norm and weights, up to
    fp32 summation order."""
    accum = tmp_path / "accum"
    args = base_args(a, accum, *ONE_DEVICE, "--grad-accum", "2")
    args[args.index("--batch-size") + 1] = "2"
    assert invoke(args).exit_code == 0
    for r1, r2 in zip(rows(accum), rows(fp32_run), strict=True):
        assert r1["step"] == r2["step"]
        assert r1["loss"] == pytest.approx(r2["loss"], rel=1e-5)
        assert r1["grad_norm"] == pytest.approx(r2["grad_norm"], rel=1e-4)
    w1, w2 = load_draft(accum / "final").weights, load_draft(fp32_run / "final").weights
    for name in w1.__dataclass_fields__:
        np.testing.assert_allclose(getattr(w1, name), getattr(w2, name), rtol=1e-4, atol=1e-6)


def _update_cosines(run: Path, baseline: Path) -> dict[str, float]:
    """Per weight, the cosine between the two runs' updates from the same (--seed 0) start."""
    final, other = load_draft(run / "final"), load_draft(baseline / "final")
    start = init_weights(DraftWeights.abstract(final.config), jax.random.key(0))
    out = {}
    for name in final.weights.__dataclass_fields__:
        d1 = np.ravel(getattr(final.weights, name) - np.asarray(getattr(start, name)))
        d2 = np.ravel(getattr(other.weights, name) - np.asarray(getattr(start, name)))
        out[name] = float(d1 @ d2 / (np.linalg.norm(d1) * np.linalg.norm(d2)))
    return out


@pytest.mark.parametrize("target_dtype", ["float32", "bfloat16"])
def test_bfloat16_trains_like_float32(a, fp32_run, tmp_path, target_dtype):
    """`--dtype bfloat16` (the draft's compute; master weights stay fp32), with the target
    in fp32 and in bf16 (the defaults users run), against fp32 on the same batches.

    bf16 keeps 8 significant bits (rounding 2^-9 = 0.2% per value). In the draft's
    compute those errors average out over the ~1000 masked tokens of a step: the loss
    agrees to 1e-3 (measured: 1e-5). A bf16 *target* also moves its argmax wherever its
    top two logits lie within rounding, and this tiny random target's logits are nearly
    flat: about 1% of the positions change whether they are trained at all (argmax in the
    draft vocab or not), each adding or removing a cross-entropy near log(512) over ~1000
    masked tokens, so there the loss agrees to 10% (measured: 5%). Adam's first steps
    are about lr * sign(g) per weight; rounding flips the sign of only the smallest
    gradients, so the update directions agree to a cosine above 0.9, where a broken path
    (gradients cut at a cast, a wrong dtype reaching the optimizer) gives unrelated or
    zero updates."""
    out = tmp_path / "run"
    args = base_args(a, out, *ONE_DEVICE)
    args[args.index("--dtype") + 1] = "bfloat16"
    args[args.index("--target-dtype") + 1] = target_dtype
    assert invoke(args).exit_code == 0
    rel = 1e-3 if target_dtype == "float32" else 0.1
    for r16, r32 in zip(rows(out), rows(fp32_run), strict=True):
        assert r16["loss"] == pytest.approx(r32["loss"], rel=rel)
    cosines = _update_cosines(out, fp32_run)
    assert min(cosines.values()) > 0.9, cosines


def test_eval_data_and_metrics(a, tmp_path):
    out = tmp_path / "run"
    r = invoke(base_args(a, out, "--max-steps", "2", "--eval-data", str(a / "heldout.jsonl"),
                         "--eval-every", "2"))
    assert r.exit_code == 0, r.output
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    train_rows = [x for x in rows if not x.get("eval")]
    evals = [x for x in rows if x.get("eval")]
    assert [e["step"] for e in evals] == [0, 2]  # the starting point, then every 2 steps
    assert len(evals[1]["acc"]) == 3 and evals[1]["masked_tokens"] > 100
    for key in ("loss", "lr", "grad_norm", "tokens_per_s", "acc", "cond_acc", "tau"):
        assert key in train_rows[-1]
    assert 1.0 <= evals[1]["tau"] <= 4.0
    # --init-from starts exactly where that draft ended: its step-0 eval is the final one
    again = tmp_path / "again"
    r = invoke(base_args(a, again, "--max-steps", "1", "--init-from", str(out / "final"),
                         "--eval-data", str(a / "heldout.jsonl")))
    assert r.exit_code == 0, r.output
    first = json.loads((again / "metrics.jsonl").read_text().splitlines()[0])
    assert first["eval"] and first["step"] == 0
    assert first["acc"] == evals[1]["acc"] and first["tau"] == evals[1]["tau"]


def test_refuses_existing_run_and_changed_config(a, tmp_path):
    out = tmp_path / "run"
    assert invoke(base_args(a, out, "--max-steps", "2")).exit_code == 0
    r = invoke(base_args(a, out, "--max-steps", "2"))
    assert r.exit_code != 0 and "already holds a run" in r.output
    r = invoke(base_args(a, out, "--max-steps", "3", "--resume", "--seed", "5"))
    assert r.exit_code == 3 and "--seed" in r.output


def test_mismatched_vocab_is_refused_before_compute(a, tmp_path):
    other = tmp_path / "other_vocab.safetensors"
    from eagle3kit.core.vocab import VocabMap
    from eagle3kit.data.fingerprint import Fingerprint
    from eagle3kit.io.draft_io import write_vocab

    write_vocab(other, VocabMap.from_ids(np.arange(512), 49152),
                {"tokenizer": Fingerprint("other", 49152, "0123456789abcdef").to_json()})
    args = base_args(a, tmp_path / "run")
    args[args.index(str(a / "vocab.safetensors"))] = str(other)
    r = invoke(args)
    assert r.exit_code == 3, r.output
    assert "tokenizer" in r.output and not (tmp_path / "run").exists()


def test_target_whose_tokenizer_renames_one_token_is_refused(a, tmp_path):
    """Same vocab size and ids as the data's tokenizer, one token string different."""
    args = base_args(a, tmp_path / "run")
    args[args.index(str(a / "target"))] = str(assets.with_renamed_token(a / "target",
                                                                        tmp_path / "twin"))
    r = invoke(args)
    assert r.exit_code == 3 and "tokenizer" in r.output, r.output
    assert not (tmp_path / "run").exists()


def test_mesh_errors(a, tmp_path):
    args = base_args(a, tmp_path / "run")
    args[args.index(MESH)] = "data=3,tensor=1"
    r = invoke(args)
    assert r.exit_code == 4 and "needs 3 devices" in r.output
    args[args.index("data=3,tensor=1")] = "data=1,tensor=8"  # 4 heads cannot be split 8 ways
    r = invoke(args)
    assert r.exit_code != 0 and "not divisible by tensor=8" in r.output


def test_corrupted_checkpoint_on_resume(a, tmp_path):
    out = tmp_path / "run"
    assert invoke(base_args(a, out, "--max-steps", "2")).exit_code == 0
    ckpt = out / "checkpoints" / "step_00000002" / "state.safetensors"
    data = bytearray(ckpt.read_bytes())
    data[-5] ^= 0xFF
    ckpt.write_bytes(bytes(data))
    r = invoke(base_args(a, out, "--max-steps", "4", "--resume"))
    assert r.exit_code == 2 and "checksum" in r.output and "step_00000002" in r.output
    assert ckpt.exists()  # nothing is deleted


def test_nan_loss_stops_and_keeps_last_good_checkpoint(a, tmp_path):
    out = tmp_path / "run"
    args = base_args(a, out, "--max-steps", "6", "--save-every", "1", "--warmup-ratio", "0")
    args[args.index("1e-3")] = "1e30"
    r = invoke(args)
    assert r.exit_code == 5, r.output
    assert "at step" in r.output and "last good checkpoint" in r.output
    assert not (out / "final").exists()
    saved = sorted(p.name for p in (out / "checkpoints").iterdir())
    assert saved and all(not p.startswith(".") for p in saved)


def test_help_has_example():
    r = runner.invoke(app, ["train", "--help"])
    assert r.exit_code == 0 and "Example" in r.output and "eagle3kit train" in r.output


@pytest.mark.slow
def test_smollm2_draft_learns_on_real_sharegpt(tmp_path):
    """The real SmolLM2-135M-Instruct and 200 real ShareGPT conversations on CPU: held-out
    acc_0 rises clearly above the untrained draft's within a short run."""
    tok = assets.smollm2_tokenizer()
    n = assets.write_token_records(tmp_path / "train.jsonl", assets.sharegpt_chats(200), tok,
                                   max_length=128)
    assets.write_token_records(tmp_path / "held.jsonl", assets.sharegpt_chats(20, skip=200),
                               tok, max_length=128)
    assets.write_vocab_for(tmp_path / "train.jsonl", tmp_path / "vocab.safetensors", 2048, tok)
    assert n > 150
    out = tmp_path / "run"
    r = invoke(["train", "--target", str(assets.smollm2_gguf()),
                "--data", str(tmp_path / "train.jsonl"),
                "--vocab", str(tmp_path / "vocab.safetensors"), "--out", str(out),
                "--seq-len", "128", "--batch-size", "4", "--ttt-length", "2",
                "--max-steps", "12", "--mesh", "data=1,tensor=1", "--dtype", "float32",
                "--target-dtype", "float32", "--lr", "3e-3", "--warmup-ratio", "0.05",
                "--eval-data", str(tmp_path / "held.jsonl"), "--eval-every", "12"])
    assert r.exit_code == 0, r.output
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    before, after = [x["acc"][0] for x in rows if x.get("eval")]
    assert after > before + 0.05 and after > 0.08, (before, after)
