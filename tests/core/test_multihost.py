"""Two JAX processes on 127.0.0.1 (CPU, gloo) train like one process on the same global batch.

Each process reads only its share of the records (every second one) and packs it; the global
batch is process 0's rows followed by process 1's. The test rebuilds exactly that batch in
one process and checks the losses of the two-process run step by step.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from eagle3kit.core import ttt
from eagle3kit.core.config import DraftConfig
from eagle3kit.core.optim import OptimConfig
from eagle3kit.core.sharding import make_mesh
from eagle3kit.core.trainer import Trainer, put_batch
from eagle3kit.data.packing import pack_epoch
from eagle3kit.io.hf import load_target, resolve_target
from eagle3kit.jobs import common
from tests import assets

STEPS, ROWS, SEQ, K = 2, 4, 128, 3


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.multiprocess
def test_two_processes_match_one(tmp_path):
    a = assets.train_assets()
    run = tmp_path / "run"
    port = free_port()
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "JAX_NUM_CPU_DEVICES": "2",
           "PYTHONUNBUFFERED": "1"}
    args = [sys.executable, "-m", "eagle3kit", "train", "--target", str(a / "target"),
            "--data", str(a / "train.jsonl"), "--vocab", str(a / "vocab.safetensors"),
            "--out", str(run), "--seq-len", str(SEQ), "--batch-size", str(ROWS),
            "--ttt-length", str(K), "--epochs", "1", "--max-steps", str(STEPS),
            "--mesh", "data=4", "--dtype", "float32", "--target-dtype", "float32",
            "--lr", "1e-3", "--coordinator", f"127.0.0.1:{port}", "--num-processes", "2"]
    procs = [subprocess.Popen([*args, "--process-id", str(i)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for i in range(2)]
    outs = [p.communicate(timeout=300)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    got = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]

    # the same global batches, built in this one process
    ckpt = resolve_target(a / "target")
    vfile = common.load_vocab_file(a / "vocab.safetensors")
    vocab = common.fit_vocab_to_target(vfile.vocab, ckpt.config.vocab_size, "")
    shards = [common.read_docs(a / "train.jsonl", vfile.fingerprint.key, SEQ, (i, 2))
              for i in range(2)]
    mesh = make_mesh("data=4", jax.devices()[:4])
    dcfg = DraftConfig.for_target(ckpt.config, vocab.draft_size)
    epoch_batches = max(-(-len(pack_epoch(d, SEQ, 0, 0).rows) // (ROWS // 2)) for d in shards)
    trainer = Trainer(ckpt.config, dcfg, ttt.TTTConfig(K, 0.8, jnp.float32),
                      OptimConfig(lr=1e-3, total_steps=epoch_batches), mesh)
    tw = load_target(ckpt, mesh, jnp.float32)
    va = jax.device_put(ttt.VocabArrays.from_map(vocab), trainer.replicated)
    state = trainer.init_state(jax.random.key(0))
    packed = [pack_epoch(d, SEQ, 0, 0) for d in shards]
    for step in range(STEPS):
        parts = [p.batch(step * ROWS // 2, ROWS // 2) for p in packed]
        arrays = {k: np.concatenate([parts[0][k], parts[1][k]])[None] for k in parts[0]}
        state, m = trainer.train_step(state, tw, va, put_batch(trainer, arrays))
        assert got[step]["step"] == step + 1
        assert got[step]["loss"] == pytest.approx(float(m.loss), rel=1e-5)
