"""Several eagle3kit processes on one GPU (jobs/gpu_share.py, issue 39, item 5): before JAX's
backend starts, what the driver says is free decides this process's share, or one line and
exit 4 where nothing worth starting fits.

No GPU here: a stand-in `nvidia-smi` on PATH says what the driver would. Through the CLI
(`eval`, teacher-forced, the tiny target) in this process, where the backend has started
already (so `_may_start_gpu` is told it has not), and once as a fresh process with no
JAX_PLATFORMS, where nothing is stubbed but the driver. On a GPU host the lead runs the
command in the report (three evaluations at once on one GPU).
"""

from __future__ import annotations

import fcntl
import json
import os
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from eagle3kit.errors import ResourceError
from eagle3kit.jobs import gpu_share
from eagle3kit.jobs.gpu_share import FRACTION, GiB, Gpu, plan
from tests import assets
from tests.cli.test_eval import invoke, tf_args

H100 = 81559  # MiB, as nvidia-smi reports an H100 80GB


def driver(tmp_path: Path, *free_mib: int) -> str:
    """A directory holding an `nvidia-smi` that reports GPUs 0, 1, .. with these MiB free."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    rows = "".join(f"{i}, GPU-{i}abc, {H100}, {free}\n" for i, free in enumerate(free_mib))
    exe = bin_dir / "nvidia-smi"
    exe.write_text(f"#!/bin/sh\nprintf '{rows}'\n")
    exe.chmod(exe.stat().st_mode | stat.S_IEXEC)
    return str(bin_dir)


@pytest.fixture
def gpu_host(tmp_path, monkeypatch):
    """This process as one whose backend is yet to start, on a host whose driver says
    `host(*free_mib)`; its start lock under tmp_path; the fraction it sets taken back."""
    monkeypatch.setattr(gpu_share, "_may_start_gpu", lambda: True)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setenv(FRACTION, "unset")  # recorded, so that monkeypatch restores it
    monkeypatch.delenv(FRACTION)

    def host(*free_mib: int) -> None:
        monkeypatch.setenv("PATH", driver(tmp_path, *free_mib) + os.pathsep + os.environ["PATH"])
    return host


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return assets.train_assets(), assets.random_draft(tmp_path_factory.mktemp("gpu") / "draft")


def test_a_gpu_others_hold_is_refused_in_one_line_before_anything_loads(tiny, gpu_host,
                                                                           monkeypatch):
    a, draft = tiny
    gpu_host(3 * 1024)  # another process took the rest
    r = invoke(tf_args(a, draft, a / "heldout.jsonl", "--json"))
    assert r.exit_code == 4, r.output
    assert r.stdout == "" and r.stderr == (
        "error: GPU 0 has 3.0 of its 79.6 GiB free (other processes hold the rest), too little "
        f"to start in: wait for them to end, or give each process a share, e.g. {FRACTION}=0.3 "
        "for three\n")
    gpu_host(30 * 1024)
    monkeypatch.setenv(FRACTION, "0.75")  # the user's own share, which does not fit
    r = invoke(tf_args(a, draft, a / "heldout.jsonl", "--json"))
    assert r.exit_code == 4, r.output
    assert r.stderr == (f"error: GPU 0 has 30.0 of its 79.6 GiB free (other processes hold "
                        f"the rest): {FRACTION}=0.75 asks for 59.7 GiB; set it to 0.32 or less, "
                        "or free the GPU\n")


def test_a_gpu_shared_with_another_process_gets_the_share_that_is_free(tiny, gpu_host):
    a, draft = tiny
    gpu_host(30 * 1024)
    r = invoke(tf_args(a, draft, a / "heldout.jsonl", "--json"))
    assert r.exit_code == 0, r.output
    assert os.environ[FRACTION] == "0.32"  # (30 GiB free - 4 GiB reserve) / 79.6 GiB
    assert r.stderr.splitlines()[0] == (
        "note: GPU 0 has 30.0 of its 79.6 GiB free (other processes hold the rest): this "
        f"process takes 0.32 of its memory ({FRACTION}=0.32; set it to choose)")
    assert json.loads(r.stdout)["mode"] == "teacher-forced"


def test_the_share_follows_the_visible_gpus_and_the_default_where_it_fits(tmp_path, gpu_host,
                                                                          monkeypatch):
    gpu_host(2 * 1024, H100 - 500)  # GPU 0 is someone else's; GPU 1 is empty
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    assert gpu_share.query_gpus() == [Gpu("1", H100 * 2**20, (H100 - 500) * 2**20)]
    assert plan(gpu_share.query_gpus(), {}) == (None, None)  # JAX's 0.75 fits
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-0abc,1")  # by UUID too: the tightest
    with pytest.raises(ResourceError, match="^GPU 0 has 2.0 of its 79.6 GiB free"):
        plan(gpu_share.query_gpus(), {})
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "MIG-1234")  # cannot be told: JAX decides
    assert gpu_share.query_gpus() is None
    four = [Gpu(str(i), 80 * GiB, 80 * GiB - 600 * 2**20) for i in range(4)]
    assert plan(four, {FRACTION: "0.3"}) == (None, None)
    # a share the user chose is trusted with what its pool leaves (multi_gpu.sh: 0.94)
    assert plan([Gpu("0", 80 * GiB, 77 * GiB)], {FRACTION: "0.94"}) == (None, None)
    with pytest.raises(ResourceError, match="0.94 asks for 75.2 GiB; set it to 0.20 or less"):
        plan([Gpu("0", 80 * GiB, 20 * GiB)], {FRACTION: "0.94"})


def test_the_backend_starts_under_the_hosts_start_lock(tmp_path, gpu_host, monkeypatch):
    """Processes started together take turns measuring and taking their pools: each sees
    what the ones before it took."""
    gpu_host(H100 - 500)
    held = []

    def start(gpus):
        fd = os.open(tmp_path / "eagle3kit-gpu-start.lock", os.O_RDONLY | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            held.append(False)
        except BlockingIOError:
            held.append(True)
        finally:
            os.close(fd)

    monkeypatch.setattr(gpu_share, "_start_backend", start)
    gpu_share.share_gpu(print)
    assert held == [True]


def test_a_fresh_process_is_refused_before_its_backend_starts(tiny, tmp_path):
    """Nothing stubbed but the driver and JAX's CUDA plugin (this machine has none): the
    check runs before JAX starts a backend (else it would be skipped) and ends the process
    with one line, exit 4."""
    a, draft = tiny
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", FRACTION,
                                                            "CUDA_VISIBLE_DEVICES")}
    env.update(PATH=driver(tmp_path, 1024) + os.pathsep + env["PATH"], TMPDIR=str(tmp_path),
               PYTHONPATH=os.pathsep.join(sys.path), COLUMNS="250")
    main = ("from eagle3kit.jobs import gpu_share; gpu_share._cuda_plugin = lambda: True; "
            "from eagle3kit.cli.app import main; main()")
    r = subprocess.run([sys.executable, "-c", main, *map(str, tf_args(
        a, draft, a / "heldout.jsonl", "--json"))], env=env, capture_output=True, text=True,
        timeout=300)
    assert r.returncode == 4, r.stderr
    assert r.stdout == "" and r.stderr.splitlines()[-1].startswith(
        "error: GPU 0 has 1.0 of its 79.6 GiB free (other processes hold the rest), too little")
    assert "Traceback" not in r.stderr
