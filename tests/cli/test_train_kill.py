"""`eagle3kit train` killed with SIGKILL or stopped with SIGTERM, then `--resume`d: the final
draft is byte for byte the one an uninterrupted run writes, and metrics.jsonl holds every step
once.

The runs are real processes on one CPU device (the tiny target of tests/assets), sharing the
session's persistent compilation cache so only the first one compiles, each forked from a
server that imported eagle3kit once (conftest's eagle3kit_server: a fresh
`python -m eagle3kit` spends seconds on imports). One run is interrupted three times and
resumed after each (one chain keeps the process count, and CI time, down):
- SIGKILL from outside, between checkpoints (steps logged past the last checkpoint are redone);
- SIGKILL from inside, in the middle of a checkpoint write (tests/cli/kill_in_checkpoint.py);
- SIGTERM (a preemption, a batch scheduler) at a random step: checkpoint at the next step
  boundary, exit 75.
"""

from __future__ import annotations

import json
import random
import signal
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest

from eagle3kit.core.draft import arrays as draft_arrays
from eagle3kit.io.draft_io import load_draft
from tests import assets, warm_cli
from tests.warm_cli import DEVNULL, PIPE

ROOT = Path(__file__).resolve().parents[2]
SAVE_EVERY, STEPS = 5, 12


def command(a: Path, out: Path, *extra: str) -> list[str]:
    return ["train", "--target", str(a / "target"), "--data", str(a / "train.jsonl"),
            "--vocab", str(a / "vocab.safetensors"), "--out", str(out), "--seq-len", "128",
            "--batch-size", "4", "--ttt-length", "3", "--epochs", "4", "--max-steps",
            str(STEPS), "--mesh", "data=1,tensor=1", "--dtype", "float32", "--target-dtype",
            "float32", "--save-every", str(SAVE_EVERY), "--lr", "1e-3", "--log-every", "1", *extra]


def start(server, args: list[str], module: str | None = None, **streams) -> warm_cli.Command:
    """`eagle3kit ARGS` (or `python -m MODULE ARGS`) as a process of its own."""
    return warm_cli.Command(server.sock, args, module=module, env=server.env, cwd=ROOT,
                            **{"stdin": DEVNULL, "stdout": DEVNULL, "stderr": DEVNULL,
                               **streams})


def run(server, args: list[str], module: str | None = None) -> subprocess.CompletedProcess:
    """Its exit status (-N: killed by signal N) and standard error, once it ended."""
    p = start(server, args, module, stderr=PIPE, text=True)
    _, err = p.communicate(timeout=300)
    return subprocess.CompletedProcess(args, p.returncode, "", err)


def train_rows(out: Path) -> list[dict]:
    path = out / "metrics.jsonl"
    if not path.exists():
        return []
    lines = path.read_text().splitlines()
    return [r for r in map(json.loads, lines) if not r.get("eval")]


def saved_steps(out: Path) -> list[int]:
    return sorted(int(p.name[5:]) for p in (out / "checkpoints").glob("step_*"))


@pytest.fixture(scope="module")
def a():
    return assets.train_assets()


@pytest.fixture(scope="module")
def uninterrupted(a, eagle3kit_server, tmp_path_factory):
    out = tmp_path_factory.mktemp("whole") / "run"
    r = run(eagle3kit_server, command(a, out))
    assert r.returncode == 0, r.stderr
    # stderr is a file, not a terminal: plain progress lines, one per --log-every, no terminal codes
    assert "step 7/12  epoch 0  loss" in r.stderr and "\x1b[" not in r.stderr, r.stderr
    return out


def _sigterm_at(step: int, args: list[str], server) -> subprocess.CompletedProcess:
    """Runs `eagle3kit ARGS` and sends it SIGTERM once it has logged `step`."""
    p = start(server, args, stderr=PIPE, text=True)
    seen = []
    for line in p.stderr:  # ends when the process does
        seen.append(line)
        if line.startswith(f"step {step}/"):
            p.send_signal(signal.SIGTERM)
            break
    rest = p.communicate(timeout=300)[1]
    return subprocess.CompletedProcess(args, p.returncode, "", "".join(seen) + rest)


@pytest.fixture(scope="module")
def killed(a, eagle3kit_server, uninterrupted, tmp_path_factory):
    """One run interrupted three times, resumed after each: SIGKILL from outside once steps
    past the first checkpoint are logged, SIGKILL from inside while writing the second
    checkpoint, SIGTERM at a random step after the first checkpoint."""
    server = eagle3kit_server
    out = tmp_path_factory.mktemp("killed") / "run"
    p = start(server, command(a, out))
    try:
        deadline = time.time() + 300
        while len(train_rows(out)) < SAVE_EVERY + 2 and p.poll() is None:
            assert time.time() < deadline, "no progress"
            time.sleep(0.005)
        p.send_signal(signal.SIGKILL)
    finally:
        assert p.wait() == -signal.SIGKILL, "the run ended before the kill"
    logged = max(r["step"] for r in train_rows(out))
    assert saved_steps(out) == [SAVE_EVERY] and SAVE_EVERY < logged < 2 * SAVE_EVERY

    r = run(server, [str(2 * SAVE_EVERY), *command(a, out, "--resume")],
            "tests.cli.kill_in_checkpoint")
    assert r.returncode == -signal.SIGKILL, r.stderr
    assert saved_steps(out) == [SAVE_EVERY]
    assert list((out / "checkpoints").glob(f".step_{2 * SAVE_EVERY:08d}.*"))  # the half one

    # step N's line is printed while step N+1 runs, just before step N+1's stop check; a
    # SIGTERM that misses that check is seen at step N+2's, unless N+2 is the last step,
    # which always finishes (exit 0): so N <= STEPS - 3
    at = random.Random().randint(SAVE_EVERY + 1, STEPS - 3)
    r = _sigterm_at(at, command(a, out, "--resume"), server)
    assert r.returncode == 75, r.stderr
    assert "SIGTERM received: stopping at the next step boundary" in r.stderr, r.stderr
    assert "stopped by SIGTERM at step" in r.stderr and "continue with --resume" in r.stderr
    assert saved_steps(out)[-1] >= at, (at, saved_steps(out))

    r = run(server, command(a, out, "--resume"))
    assert r.returncode == 0, r.stderr
    assert saved_steps(out)[-1] == STEPS
    return out


def test_interrupted_thrice_and_resumed_equals_uninterrupted(killed, uninterrupted):
    """Byte-identical final files and weights, and every step's logged row the uninterrupted
    run's (timing aside)."""
    for name in ("draft.safetensors", "vocab.safetensors"):
        assert (killed / "final" / name).read_bytes() == \
            (uninterrupted / "final" / name).read_bytes(), name
    got, want = load_draft(killed / "final").weights, load_draft(uninterrupted / "final").weights
    for name in draft_arrays(want):
        g, w = np.asarray(getattr(got, name)), np.asarray(getattr(want, name))
        assert g.dtype == w.dtype and g.tobytes() == w.tobytes(), name

    def untimed(out):
        return [{k: v for k, v in r.items() if k != "tokens_per_s"} for r in train_rows(out)]

    assert untimed(killed) == untimed(uninterrupted)


def test_metrics_hold_every_step_once_after_kills(killed):
    """`--resume` cuts metrics.jsonl back to the checkpoint it resumes from (issue #16)."""
    assert [r["step"] for r in train_rows(killed)] == list(range(1, STEPS + 1))
