"""`train` as two JAX processes of two CPU devices each (127.0.0.1, gloo) equals `train` as
one process driving four: the same losses, evaluations and final draft.

This is how a cluster starts it (one process per GPU or per host, `--coordinator
--num-processes --process-id`): every process reads all records and packs the same epoch,
and each places its own devices' rows of the global batch, so the process count changes
where rows are computed, not which.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import jax
import numpy as np
import pytest
from typer.testing import CliRunner

from eagle3kit.cli.app import app
from eagle3kit.io.draft_io import load_draft
from tests import assets

STEPS, ROWS, SEQ, K = 3, 4, 128, 3


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def records(run) -> list[dict]:
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.multiprocess
def test_two_processes_train_like_one(tmp_path):
    a = assets.train_assets()
    common = ["train", "--target", str(a / "target"), "--data", str(a / "train.jsonl"),
              "--eval-data", str(a / "heldout.jsonl"), "--vocab", str(a / "vocab.safetensors"),
              "--seq-len", str(SEQ), "--batch-size", str(ROWS), "--ttt-length", str(K),
              "--epochs", "1", "--max-steps", str(STEPS), "--mesh", "data=4", "--dtype",
              "float32", "--target-dtype", "float32", "--lr", "1e-3"]
    two, one = tmp_path / "two", tmp_path / "one"
    port = free_port()
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "JAX_NUM_CPU_DEVICES": "2",
           "PYTHONUNBUFFERED": "1"}
    procs = [subprocess.Popen([sys.executable, "-m", "eagle3kit", *common, "--out", str(two),
                               "--coordinator", f"127.0.0.1:{port}", "--num-processes", "2",
                               "--process-id", str(i)], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True)
             for i in range(2)]
    # meanwhile, one process driving four of this process's eight CPU devices
    result = CliRunner().invoke(app, [*common, "--out", str(one)])
    assert result.exit_code == 0, result.output
    outs = [p.communicate(timeout=600)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs

    got, want = records(two), records(one)
    assert [r["step"] for r in got] == [r["step"] for r in want] == [0, 1, 2, 3, 3]
    assert [r.get("eval", False) for r in got] == [True, False, False, False, True]
    for g, w in zip(got, want, strict=True):
        # the same rows and the same arithmetic per device; only the sums over devices are
        # grouped differently (gloo across processes, XLA within one): fp32 rounding. Seen:
        # the logged values equal, the draft's weights within 6e-7 after 3 AdamW steps
        for key in ("loss", "grad_norm", "tokens", "acc", "cond_acc", "tau"):
            if key in w:
                assert g[key] == pytest.approx(w[key], rel=1e-5, abs=1e-6), (key, g, w)
    d2, d1 = load_draft(two / "final"), load_draft(one / "final")
    np.testing.assert_array_equal(d2.vocab.used_ids, d1.vocab.used_ids)
    for x, y in zip(jax.tree.leaves(d2.weights), jax.tree.leaves(d1.weights), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-5, atol=1e-6)
    assert d2.training["data_records"] == d1.training["data_records"]

