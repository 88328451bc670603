"""`eagle3kit train` stopped by signals through the CLI, as real processes (forked from
conftest's eagle3kit_server): SIGUSR1 and Ctrl-C while JAX starts, and Ctrl-C between steps
(the checkpoint is the step in flight).
SIGKILL and SIGTERM followed by --resume are tests/cli/test_train_kill.py.

The target is a tiny random Llama with SmolLM2's real tokenizer (tests/assets.train_assets).
"""

from __future__ import annotations

import json
import re
import signal
import time
from pathlib import Path

import pytest

from tests import assets, warm_cli
from tests.cli.test_train import MESH, base_args, rows


@pytest.fixture(scope="module")
def a():
    return assets.train_assets()


def _train_process(server, a: Path, out: Path, *extra: str) -> warm_cli.Command:
    """`eagle3kit train` as a real process of its own (forked from the session's server: no
    fresh interpreter's seconds of imports), its stderr a pipe."""
    args = base_args(a, out, "--max-steps", "12", "--save-every", "5", "--log-every", "1",
                     *extra)
    # 9 steps per epoch: --max-steps 12 needs a second (4 epochs, as test_train_kill's runs;
    # the epochs no longer shape the train program: core/optim.py)
    args[args.index("--epochs") + 1] = "4"
    args[args.index(MESH)] = "data=1,tensor=1"
    return warm_cli.Command(server.sock, args, env=server.env, stdin=warm_cli.DEVNULL,
                            stdout=warm_cli.DEVNULL, stderr=warm_cli.PIPE, text=True)


def _wait_for_handlers(p: warm_cli.Command) -> None:
    """Until the process catches SIGUSR1, which only the job's stop handler (jobs/preempt.py)
    catches: it is installed and JAX is starting. (SIGTERM is caught earlier, by every
    command's error handler: a signal sent then meets no stop handler yet.)"""
    deadline = time.time() + 60
    while time.time() < deadline and p.poll() is None:
        for line in open(f"/proc/{p.pid}/status"):
            if line.startswith("SigCgt:") and int(line.split()[1], 16) >> (signal.SIGUSR1 - 1) & 1:
                return
        time.sleep(0.01)


def test_stop_signals_during_start_up_exit_cleanly(a, eagle3kit_server, tmp_path):
    """SIGUSR1 (SLURM's warning ahead of a time limit) while JAX starts and compiles: a clean,
    resumable stop (it was exit 139), nothing half-made. Ctrl-C, then Ctrl-C again, quits at
    once."""
    p = _train_process(eagle3kit_server, a, tmp_path / "run")
    _wait_for_handlers(p)
    p.send_signal(signal.SIGUSR1)
    _, err = p.communicate(timeout=300)
    assert p.returncode == 75 and "Traceback" not in err, (p.returncode, err)
    assert "SIGUSR1 received: stopping at" in err and "stopped by SIGUSR1" in err, err
    p = _train_process(eagle3kit_server, a, tmp_path / "again")
    _wait_for_handlers(p)
    p.send_signal(signal.SIGINT)
    time.sleep(0.3)
    p.send_signal(signal.SIGINT)
    _, err = p.communicate(timeout=60)
    # ended by SIGINT's default action (a shell reports 130), at once, without a traceback
    assert "SIGINT received: stopping at" in err, err
    assert p.returncode == -signal.SIGINT and "Traceback" not in err, (p.returncode, err)


def test_ctrl_c_stops_at_the_boundary_after_the_step_in_flight(a, eagle3kit_server, tmp_path):
    """Ctrl-C once step k is logged: step k+1 is in flight, and the checkpoint is step k+1;
    no step is started after the signal (it was k+2: the flag was read only after the next
    step was dispatched)."""
    out = tmp_path / "run"
    p = _train_process(eagle3kit_server, a, out)
    deadline = time.time() + 240
    logged: list[int] = []
    while time.time() < deadline and p.poll() is None and len(logged) < 3:
        time.sleep(0.01)  # a step takes ~0.3 s: the stop below lands just after a step's line
        if (out / "metrics.jsonl").exists():
            logged = [json.loads(x)["step"] for x in (out / "metrics.jsonl").read_text()
                      .splitlines(keepends=True) if x.endswith("\n")]
    p.send_signal(signal.SIGSTOP)  # frozen: what it has logged is what it did
    text = (out / "metrics.jsonl").read_text()
    k = max(json.loads(x)["step"] for x in text.splitlines(keepends=True) if x.endswith("\n"))
    p.send_signal(signal.SIGINT)
    p.send_signal(signal.SIGCONT)
    _, err = p.communicate(timeout=120)
    assert p.returncode == 75, err
    stopped = int(re.search(r"stopped by SIGINT at step (\d+)/12", err).group(1))
    assert k <= stopped <= k + 1 < 12, (k, err)
    assert sorted(int(c.name[5:]) for c in (out / "checkpoints").glob("step_*"))[-1] == stopped
    assert [r["step"] for r in rows(out) if not r.get("eval")] == list(range(1, stopped + 1))
