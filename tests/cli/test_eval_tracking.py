"""`train --track` and `eval --track` through the CLI, read back: TensorBoard event files and
W&B offline runs (WANDB_MODE=offline, no network).

One tiny training run (tests/assets.train_assets) logs to both trackers; its final draft is
evaluated teacher-forced into the same run directory (the default) and by generation into
another one (--track-dir). Every tracker run is written once per module and read by the tests.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from eagle3kit.cli.app import app
from tests import assets
from tests.cli.test_train import tensorboard_scalars

wandb = pytest.importorskip("wandb")  # the `track` extra; in the `test` extra too

runner = CliRunner()
FP32 = ["--dtype", "float32", "--target-dtype", "float32"]
SHAPE = ["--seq-len", "128", "--batch-size", "4", "--mesh", "data=1,tensor=1", *FP32]


def invoke(args, input=None):
    result = runner.invoke(app, [str(a) for a in args], input=input)
    if result.exception and not isinstance(result.exception, SystemExit):
        raise result.exception
    return result


def wandb_runs(directory: Path) -> list[dict]:
    """Every offline W&B run under directory/wandb, read back from its .wandb transaction log
    (LevelDB log blocks of protobuf Records): its run record's name, group and job type and
    its history rows, by step."""
    from wandb.proto.wandb_internal_pb2 import Record

    runs = []
    for path in sorted(directory.glob("wandb/offline-run-*/run-*.wandb")):
        data, block = path.read_bytes(), 32768
        assert data[:4] == b":W&B", path
        pos, chunk, run = 7, b"", {"history": {}}
        while pos + 7 <= len(data):
            if block - pos % block < 7:  # a block's tail too short for a header is padding
                pos += block - pos % block
                continue
            n, kind = int.from_bytes(data[pos + 4:pos + 6], "little"), data[pos + 6]
            chunk, pos = chunk + data[pos + 7:pos + 7 + n], pos + 7 + n
            if kind not in (1, 4):  # FIRST and MIDDLE fragments: the record goes on
                continue
            record = Record.FromString(chunk)
            chunk = b""
            if record.HasField("run"):
                run.update(name=record.run.display_name, group=record.run.run_group,
                           job_type=record.run.job_type)
            elif record.HasField("history"):
                row = {x.key or "/".join(x.nested_key): json.loads(x.value_json)
                       for x in record.history.item}
                run["history"][record.history.step.num] = {k: v for k, v in row.items()
                                                           if not k.startswith("_")}
        runs.append(run)
    return runs


@pytest.fixture(scope="module")
def tracked(tmp_path_factory):
    """(assets, run dir, generate track dir, teacher-forced result, generate result)."""
    a = assets.train_assets()
    tmp = tmp_path_factory.mktemp("tracking")
    with pytest.MonkeyPatch.context() as mp:
        for name in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
            mp.setenv(name, str(tmp / "wandb-home"))
        mp.setenv("WANDB_MODE", "offline")
        run = tmp / "run"
        # the one-device run of test_train_equivalences (its fp32_run): one train program
        r = invoke(["train", "--target", a / "target", "--data", a / "train.jsonl",
                    "--vocab", a / "vocab.safetensors", "--out", run, "--ttt-length", 3,
                    "--eval-data", a / "heldout.jsonl", "--eval-every", 2, "--max-steps", 2,
                    "--lr", "1e-3", "--epochs", 1, "--track", "tensorboard,wandb", *SHAPE])
        assert r.exit_code == 0, r.output
        r = invoke(["eval", "--target", a / "target", "--draft", run / "final",
                    "--data", a / "heldout.jsonl", "--json", "--track", "tensorboard,wandb",
                    *SHAPE])
        assert r.exit_code == 0, r.output
        assert f"logged to tensorboard, wandb in {run} (step 2)" in r.stderr
        tf = json.loads(r.stdout)  # the trackers kept stdout clean
        other = tmp / "evals"
        prompts = tmp / "prompts.jsonl"
        prompts.write_text(json.dumps({"question_id": 1, "turns": ["Name three colours."]}) + "\n")
        r = invoke(["eval", "--target", a / "target", "--draft", run / "final",
                    "--prompts", prompts, "--max-new-tokens", 8, "--json",
                    "--track", "tensorboard", "--track-dir", other, *FP32])
        assert r.exit_code == 0, r.output
        return a, run, other, tf, json.loads(r.stdout)


def test_train_logs_to_wandb_what_metrics_jsonl_holds(tracked):
    _, run, _, _, _ = tracked
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    train = next(x for x in wandb_runs(run) if x["job_type"] == "train")
    assert train["name"] == train["group"] == run.name
    for row in rows:
        prefix = "eval/" if row.get("eval") else ""
        logged = train["history"][row["step"]]
        assert logged[prefix + "tau"] == pytest.approx(row["tau"])
        assert [logged[f"{prefix}acc/{k}"] for k in range(3)] == pytest.approx(row["acc"])
        if not row.get("eval"):
            assert logged["loss"] == pytest.approx(row["loss"])
    assert sorted(train["history"]) == sorted({x["step"] for x in rows}) == [0, 1, 2]


def test_eval_logs_beside_the_training_curves_at_the_drafts_step(tracked):
    """runs/x/final evaluated with --track and no --track-dir: into runs/x, at step 2 (where
    training stopped), under eval/heldout/...; train's own held-out eval at step 2 scored
    the same weights on the same data, so the two agree."""
    _, run, _, tf, _ = tracked
    events = tensorboard_scalars(run / "tensorboard")
    assert events["eval/heldout/tau"] == [(2, pytest.approx(tf["tau"]))]
    assert events["eval/heldout/tau"][0][1] == pytest.approx(events["eval/tau"][-1][1])
    for k in range(3):
        assert events[f"eval/heldout/acc/{k}"] == [(2, pytest.approx(tf["acc"][k]))]
        assert events[f"eval/heldout/cond_acc/{k}"] == [(2, pytest.approx(tf["cond_acc"][k]))]
    assert "eval/heldout/steps" not in events  # a setting, not a measurement
    evals = [x for x in wandb_runs(run) if x["job_type"] == "eval"]
    assert [(x["name"], x["group"]) for x in evals] == [(f"{run.name}-eval-heldout", run.name)]
    logged = evals[0]["history"]
    assert list(logged) == [2]
    assert logged[2]["eval/heldout/tau"] == pytest.approx(tf["tau"])
    assert logged[2]["eval/heldout/masked_tokens"] == tf["masked_tokens"]


def test_generation_logs_tau_speed_and_speedup_into_track_dir(tracked):
    _, run, other, _, gen = tracked
    events = tensorboard_scalars(other / "tensorboard")
    for key in ("tau_generate", "tau_pooled", "tau_per_request_mean", "speedup",
                "tokens_per_s_speculative", "tokens_per_s_baseline", "tau"):
        assert events[f"eval/prompts/{key}"] == [(2, pytest.approx(gen[key]))], key
    assert not (other / "wandb").exists()  # tensorboard only, as asked
    assert not any(k.startswith("eval/prompts/") for k in tensorboard_scalars(run / "tensorboard"))


@pytest.mark.parametrize("extra, message", [
    (["--track", "tensorboard"], "is not inside a training run directory (no metrics.jsonl "
                                 "beside it); name one with --track-dir"),
    (["--track-dir", "somewhere"], "--track-dir names where --track logs"),
    (["--track", "mlflow"], "--track 'mlflow': choose tensorboard, wandb"),
])
def test_track_mistakes_are_refused_before_any_work(tracked, tmp_path, extra, message):
    a, run, _, _, _ = tracked
    draft = tmp_path / "final"  # a draft outside any run directory
    draft.symlink_to(run / "final")
    r = invoke(["eval", "--target", a / "target", "--draft", draft,
                "--data", a / "heldout.jsonl", *extra])
    assert r.exit_code == 2 and message in r.output, r.output
    assert "eval: draft" not in r.output  # nothing was loaded
    assert not (tmp_path / "somewhere").exists() and not (tmp_path / "tensorboard").exists()
