"""Programs shared by the runs of one process (a sweep, a resumed run, an eval's engines, the
CLI tests): Trainers of one combination (target, draft, TTT and optimizer configs, mesh)
share their jitted programs, and a combination that differs gets programs of its own; a
target loaded again is split into layers by the programs compiled the first time."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from eagle3kit.core import ttt
from eagle3kit.core.optim import OptimConfig
from eagle3kit.core.target import unstack_in_place
from eagle3kit.core.trainer import Trainer
from eagle3kit.io.hf import load_target, resolve_target
from tests import assets
from tests.programs import traced


def test_equal_trainers_share_programs_and_a_different_one_does_not(tmp_path):
    """Built, not run (tests/cli/test_train.py runs `train` again and sees nothing traced;
    its NaN run, another --lr, sees its own schedule)."""
    tcfg, _, dcfg, _, _, mesh = assets.tiny_target_and_draft(tmp_path)
    optim = OptimConfig(lr=1e-3, warmup_ratio=0.0, total_steps=10)
    cfg = ttt.TTTConfig(steps=2, compute_dtype=jnp.float32)
    first, second = (Trainer(tcfg, dcfg, cfg, optim, mesh) for _ in range(2))
    assert second._jitted is first._jitted
    for other in (dataclasses.replace(optim, lr=5e-4), dataclasses.replace(optim, total_steps=9)):
        assert Trainer(tcfg, dcfg, cfg, other, mesh)._jitted is not first._jitted
    assert Trainer(tcfg, dcfg, dataclasses.replace(cfg, steps=3), optim,
                   mesh)._jitted is not first._jitted


def test_a_target_loaded_again_is_split_and_fused_by_the_same_programs(tmp_path):
    tcfg, _, _, _, _, mesh = assets.tiny_target_and_draft(tmp_path)
    ckpt = resolve_target(tmp_path)
    for fuse in (True, False):  # decoding's layout, the trainer's
        first = unstack_in_place(load_target(ckpt, mesh, jnp.float32), tcfg, fuse=fuse)
        with traced() as names:
            again = unstack_in_place(load_target(ckpt, mesh, jnp.float32), tcfg, fuse=fuse)
        assert names == []
        for a, b in zip(jax.tree.leaves(first), jax.tree.leaves(again), strict=True):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
