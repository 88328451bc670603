"""`eagle3kit train` through the CLI: a run end to end, exact resume, metrics, bad input.

The target is a tiny random Llama with SmolLM2's real tokenizer; the data are real ShareGPT
conversations rendered with SmolLM2's chat template (tests/assets.train_assets).
Runs that must agree (mesh, accumulation, bfloat16), stops by signals and the real SmolLM2 are
in test_train_equivalences.py, test_train_signals.py and test_train_smollm2.py.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest
from typer.testing import CliRunner

from eagle3kit.cli.app import app
from eagle3kit.core.draft import arrays as draft_arrays
from eagle3kit.core.optim import OptimConfig, schedule
from eagle3kit.io.draft_io import load_draft
from eagle3kit.jobs import train as train_job
from tests import assets
from tests.programs import traced

runner = CliRunner()
MESH = "data=4,tensor=2"  # 8 simulated CPU devices (conftest)
ONE_DEVICE = ["--max-steps", "2", "--mesh", "data=1,tensor=1"]


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


def tensorboard_scalars(directory: Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar of the TFRecord event files in `directory`, by tag, in step order."""
    from tensorboardX.proto.event_pb2 import Event

    out: dict[str, list[tuple[int, float]]] = {}
    for path in sorted(directory.glob("events.out.tfevents.*")):
        data = path.read_bytes()
        i = 0
        while i < len(data):  # u64 length, u32 crc, payload, u32 crc
            n = int.from_bytes(data[i:i + 8], "little")
            event = Event.FromString(data[i + 12:i + 12 + n])
            i += 16 + n
            for v in event.summary.value:
                out.setdefault(v.tag, []).append((event.step, v.simple_value))
    return {k: sorted(v) for k, v in out.items()}


def rows(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def a():
    return assets.train_assets()


def test_train_resume_equals_uninterrupted(a, tmp_path, monkeypatch):
    whole = tmp_path / "whole"
    r = invoke(base_args(a, whole, "--max-steps", "4"))
    assert r.exit_code == 0, r.output
    first = tmp_path / "part"
    # interrupted by the wall-clock limit after step 1: a step as slow as a fresh process's
    # first (its compilation), since a second run in one process traces no step again
    step = train_job._step

    def slow_step(*args):
        out = step(*args)
        time.sleep(1.1)
        return out

    monkeypatch.setattr(train_job, "_step", slow_step)
    with traced() as names:
        r = invoke(base_args(a, first, "--max-steps", "4", "--time-limit", "1"))
    monkeypatch.undo()
    assert "_train_step" not in names, names
    assert r.exit_code == 75 and "--resume" in r.output, r.output
    # a stop that was asked for is no error; no rate before one was measured (issue 39)
    assert "error:" not in r.output and " 0 tok/s" not in r.output, r.output
    assert not (first / "final").exists()
    r = invoke(base_args(a, first, "--max-steps", "2", "--resume"))  # a capped run ...
    assert r.exit_code == 0, r.output
    r = invoke(base_args(a, first, "--max-steps", "4", "--resume"))  # ... continued
    assert r.exit_code == 0, r.output
    assert [s for s, _ in losses(whole)] == [1, 2, 3, 4]
    assert losses(first) == losses(whole)
    a_w, b_w = load_draft(whole / "final"), load_draft(first / "final")
    for name in draft_arrays(a_w.weights):
        np.testing.assert_array_equal(getattr(a_w.weights, name), getattr(b_w.weights, name))
    final = load_draft(whole / "final")
    assert final.training["steps"] == 4 and final.vocab.target_size == 49152
    assert final.config.aux_layer_ids == (2, 4, 5)
    recorded = json.loads((whole / "config.json").read_text())
    assert set(recorded["fingerprints"]) == {"tokenizer", "data", "vocab", "target"}
    expected = [(x["step"], x["loss"], x["lr"]) for x in rows(whole)]
    assert expected[0][2] > 0  # step 1 learns: warmup does not start at lr 0
    # step n is given the schedule's value at count n - 1 (an input of the step: core/optim.py)
    at = jax.jit(schedule(OptimConfig(lr=1e-3, total_steps=final.training["planned_steps"])))
    assert [x[2] for x in expected] == [at(np.int32(n - 1)).item() for n in (1, 2, 3, 4)]

    # killed after the checkpoint at step 2 had logged steps 3 and 4 (and a cut line):
    # --resume logs each re-run step once, metrics.jsonl reads as one run
    shutil.rmtree(first / "checkpoints" / "step_00000004")
    shutil.rmtree(first / "final")
    with open(first / "metrics.jsonl", "a") as f:
        f.write('{"step": 5, "epo')
    r = invoke(base_args(a, first, "--max-steps", "4", "--resume"))
    assert r.exit_code == 0 and "resuming" in r.output and "from step 2" in r.output, r.output
    assert [(x["step"], x["loss"], x["lr"]) for x in rows(first)] == expected
    # killed before its first checkpoint: --resume starts at step 1, the log from scratch
    shutil.rmtree(first / "checkpoints")
    shutil.rmtree(first / "final")
    r = invoke(base_args(a, first, "--max-steps", "4", "--resume"))
    assert r.exit_code == 0, r.output
    assert "stopped before its first checkpoint" in r.output, r.output
    assert "starting it over from step 1" in r.output, r.output
    assert [(x["step"], x["loss"], x["lr"]) for x in rows(first)] == expected
    # ... nor does it block its --out for a run with other settings, with or without
    # --resume: a config.json without a checkpoint claims no run (issue 24, item 5)
    for resume in ([], ["--resume"]):
        shutil.rmtree(first / "checkpoints")
        shutil.rmtree(first / "final")
        r = invoke(base_args(a, first, "--max-steps", "1", "--seed", "5", *resume))
        assert r.exit_code == 0 and "starting it over" in r.output, r.output
        assert [x["step"] for x in rows(first)] == [1]


def test_eval_data_and_metrics(a, tmp_path):
    out = tmp_path / "run"
    r = invoke(base_args(a, out, "--max-steps", "2", "--eval-data", str(a / "heldout.jsonl"),
                         "--eval-every", "2", "--track", "tensorboard"))
    assert r.exit_code == 0, r.output
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    # the counts add up: every record read is used or dropped, "cut" counts used ones only
    m = re.search(r"(\d+) records read, (\d+) used \([\d,]+ tokens; (\d+) cut to --seq-len "
                  r"128\)(?:, (\d+) dropped \(no assistant token in their first 128 "
                  r"tokens\))?", r.output)
    assert m, r.output
    read, used, cut, dropped = (int(x or 0) for x in m.groups())
    assert read == len((a / "train.jsonl").read_text().splitlines()) == used + dropped
    assert cut <= used
    # the TensorBoard events, read back: the same numbers as metrics.jsonl, by step
    events = tensorboard_scalars(out / "tensorboard")
    assert events["loss"] == [(x["step"], pytest.approx(x["loss"])) for x in rows
                              if not x.get("eval")]
    assert events["eval/tau"] == [(x["step"], pytest.approx(x["tau"])) for x in rows
                                  if x.get("eval")]
    assert len([k for k in events if k.startswith("acc/")]) == 3
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
    assert " x 1 epoch = " in r.output and "done: 1 step in " in r.output, r.output  # not "1 steps"
    first = json.loads((again / "metrics.jsonl").read_text().splitlines()[0])
    assert first["eval"] and first["step"] == 0
    assert first["acc"] == evals[1]["acc"] and first["tau"] == evals[1]["tau"]


def test_refuses_existing_run_and_changed_config(a, tmp_path):
    """(Its first run also traces step 1 with --profile-steps: one compilation saved.)"""
    out = tmp_path / "run"
    r = invoke(base_args(a, out, "--max-steps", "2", "--profile-steps", "2:1"))
    assert r.exit_code == 2 and "--profile-steps" in r.output and not out.exists()
    assert invoke(base_args(a, out, "--max-steps", "2", "--profile-steps", "1:2")).exit_code == 0
    traces = list((out / "profile").rglob("*.xplane.pb"))
    assert len(traces) == 1 and traces[0].stat().st_size > 0
    r = invoke(base_args(a, out, "--max-steps", "2"))
    assert r.exit_code != 0 and "already holds a run" in r.output
    r = invoke(base_args(a, out, "--max-steps", "3", "--resume", "--seed", "5"))
    assert r.exit_code == 3 and "--seed" in r.output and "in another --out" in r.output


def test_refuses_a_folder_holding_another_tools_config(a, tmp_path):
    """A model or export folder (its config.json is Hugging Face's, SGLang's) is not a run
    directory: refused before any loading, its config.json left as it was (issue 39)."""
    out = tmp_path / "export"
    out.mkdir()
    config = out / "config.json"
    shutil.copy(a / "target" / "config.json", config)
    before = config.read_bytes()
    for extra in ([], ["--resume"]):
        r = invoke(base_args(a, out, "--max-steps", "1", *extra))
        assert r.exit_code == 2, r.output
        assert r.output == (f"error: {out}: holds a config.json that no eagle3kit training run "
                            "wrote (a model or an export?); training would replace it: choose "
                            "another --out\n"), r.output
    assert config.read_bytes() == before and [p.name for p in out.iterdir()] == ["config.json"]


# One train program for the two tests below (EAGLE-3.1, TV, verify weights, one device): each
# other combination compiles its own train step, the costliest compile of a tiny run.
LOSS_RUN = [*ONE_DEVICE, "--loss", "tv", "--position-weights", "verify", "--arch", "eagle3.1"]


def test_eagle31_draft_trains_and_its_architecture_is_kept(a, tmp_path):
    out = tmp_path / "run"
    r = invoke(base_args(a, out, *LOSS_RUN))
    assert r.exit_code == 0, r.output
    final = load_draft(out / "final")
    assert final.config.arch == "eagle3.1" and final.training["arch"] == "eagle3.1"
    # what the card says of a run cut short and of a filled vocab (issue 39, item 9)
    assert (final.training["steps"], final.training["planned_steps"]) == (2, 9)
    assert isinstance(final.training["vocab_filled"], int)
    assert final.weights.fc_norm.shape == (3, final.config.target_hidden_size)
    assert all(np.isfinite(x).all() for _, x in losses(out))
    # the norms trained: the fc norms moved away from their initial ones
    assert not np.allclose(final.weights.fc_norm, 1.0)
    args = base_args(a, out, *LOSS_RUN[:-2], "--resume")  # --arch left at eagle3
    args[args.index("--max-steps") + 1] = "3"
    r = invoke(args)
    assert r.exit_code == 3 and "--arch" in r.output, r.output


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
    # the vocab is blamed (not the data), and the fix is to re-select it
    assert (f"{other}: the vocab was made with tokenizer 49152:0123456789abcdef, but the "
            "tokenizer of --target") in r.output and "re-tokenize" not in r.output, r.output
    assert "vocab-select" in r.output and not (tmp_path / "run").exists()


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
    # diverged before its first checkpoint: no step to --resume from is named (issue 39)
    early = tmp_path / "early"
    args = base_args(a, early, "--max-steps", "6", "--save-every", "100", "--warmup-ratio", "0")
    args[args.index("1e-3")] = "1e30"
    r = invoke(args)
    assert r.exit_code == 5, r.output
    assert "No checkpoint was written before it" in r.output, r.output
    assert "last good checkpoint" not in r.output and "then --resume" not in r.output
    assert not (early / "checkpoints").exists() or not any((early / "checkpoints").iterdir())


def test_loss_and_step_weights_are_trained_recorded_and_pinned(a, tmp_path):
    """`--loss tv --position-weights verify` trains (the TV at step 1, before any update),
    lands in config.json, the draft's training record and the model card; resuming with
    another loss or other weights is refused in one line, before anything is written."""
    out = tmp_path / "run"
    r = invoke(base_args(a, out, *LOSS_RUN))
    assert r.exit_code == 0, r.output
    # measured on this data: kl 2.412, nla 0.0989, lk-hybrid 0.0849, jsd 0.0159
    assert losses(out)[0][1] == pytest.approx(0.0870, abs=1e-3), losses(out)
    recorded = json.loads((out / "config.json").read_text())["config"]
    assert (recorded["loss"], recorded["position_weights"]) == ("tv", "verify")
    assert load_draft(out / "final").training["loss"] == "tv"
    export = tmp_path / "export"
    assert invoke(["convert", str(out / "final"), "--to", "sglang", "-o", str(export)]
                  ).exit_code == 0
    r = invoke(["push", str(export), "--repo-id", "my-org/tiny-Eagle3", "--dry-run"])
    assert r.exit_code == 0, r.output
    card = (export / "README.md").read_text()
    assert "| Loss | total variation (1 - alpha) against the target's distribution; " \
           "verification-aware step weights" in card, card

    before = (out / "config.json").read_text()
    for option, value, old in (("--loss", "kl", "tv"), ("--position-weights", "geometric",
                                                        "verify")):
        args = base_args(a, out, *LOSS_RUN, "--resume")
        args[args.index(option) + 1] = value
        args[args.index("--max-steps") + 1] = "3"
        r = invoke(args)
        assert r.exit_code == 3, r.output
        assert r.output.strip() == (f"error: {out / 'config.json'}: {option} is {value!r} but "
                                    f"the run was started with {old!r}; resume with its "
                                    "settings, or start a new run in another --out"), r.output
    assert (out / "config.json").read_text() == before
    assert not (out / "checkpoints" / "step_00000003").exists()
    # a run recorded before --loss existed was trained with today's default, kl
    older = json.loads(before)
    del older["config"]["loss"]
    (out / "config.json").write_text(json.dumps(older))
    r = invoke(base_args(a, out, *LOSS_RUN, "--resume"))
    assert r.exit_code == 3 and "--loss is 'tv' but the run was started with 'kl'" in r.output


def test_help_has_example():
    r = runner.invoke(app, ["train", "--help"])
    assert r.exit_code == 0 and "Example" in r.output and "eagle3kit train" in r.output


@pytest.mark.parametrize("option,value,message", [
    ("--lr", "-1", "--lr -1: must be a positive number"),
    ("--lr", "0", "--lr 0: must be a positive number"),
    ("--decay", "-2", "--decay -2: must be in (0, 1]"),
    ("--clip-norm", "0", "--clip-norm 0: must be a positive number"),
    ("--warmup-ratio", "1", "--warmup-ratio 1: must be in [0, 1)"),
    ("--epochs", "0", "--epochs 0: must be at least 1"),
    ("--dtype", "float16", "'float16': choose bfloat16, float32"),
    ("--attention", "flash", "'flash': choose auto, xla, cudnn, pallas"),
    ("--arch", "eagle4", "--arch 'eagle4': choose eagle3, eagle3.1, eagle3.1-fc"),
    ("--loss", "nonsense", "error: --loss 'nonsense': choose kl, tv, nla, lk-hybrid, jsd\n"),
    ("--position-weights", "uniform", "error: --position-weights 'uniform': choose geometric, "
     "verify\n"),
])
def test_options_are_refused_before_anything_loads(a, tmp_path, option, value, message):
    args = base_args(a, tmp_path / "run")
    if option in args:
        args[args.index(option) + 1] = value
    else:
        args += [option, value]
    r = invoke(args)
    assert r.exit_code == 2 and message in r.output, r.output
    assert not (tmp_path / "run").exists()


def test_unknown_or_missing_tracker_is_refused_at_once(a, tmp_path, monkeypatch):
    r = invoke(base_args(a, tmp_path / "run", "--track", "mlflow"))
    assert r.exit_code == 2 and "--track 'mlflow': choose tensorboard, wandb" in r.output
    monkeypatch.setattr(sys, "path", [])  # no package can be found
    monkeypatch.delitem(sys.modules, "tensorboardX", raising=False)
    r = invoke(base_args(a, tmp_path / "run", "--track", "tensorboard"))
    assert r.exit_code == 2 and "pip install 'eagle3kit[track]'" in r.output, r.output
    assert not (tmp_path / "run").exists()


def test_out_that_is_a_file_is_refused_without_suggesting_force(a, tmp_path):
    (tmp_path / "run").write_text("a file")
    r = invoke(base_args(a, tmp_path / "run"))
    assert r.exit_code == 2 and "is a file; --out is a run directory" in r.output, r.output
    assert "--force" not in r.output


def test_help_is_not_cut_at_80_columns_in_a_pipe():
    """`eagle3kit train --help | less` (no terminal anywhere): whole lines of help, not
    sentences broken at column 80; a terminal's width (COLUMNS here) is still used."""
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "TERMINAL_WIDTH")}
    env["PYTHONPATH"] = os.pathsep.join(sys.path)
    p = subprocess.run([sys.executable, "-m", "eagle3kit", "train", "--help"], env=env,
                       stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    lines = [line.strip(" │") for line in p.stdout.splitlines()]
    assert any(line.endswith("Target model: HF directory, .gguf file or Hub id.")
               for line in lines), p.stdout  # an option's help, unbroken
    assert "Each step runs the target (frozen) on packed rows of --seq-len tokens, captures " \
           "three" in lines, p.stdout  # the docstring's own line, unbroken
    narrow = runner.invoke(app, ["train", "--help"], env={"COLUMNS": "60"})
    assert max(map(len, narrow.output.splitlines())) <= 60, narrow.output
