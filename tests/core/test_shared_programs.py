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
from eagle3kit.core.optim import OptimConfig, schedule
from eagle3kit.core.target import unstack_in_place
from eagle3kit.core.trainer import Trainer
from eagle3kit.io.hf import load_target, resolve_target
from tests import assets
from tests.programs import traced


def test_equal_trainers_share_programs_and_a_different_one_does_not(tmp_path):
    """Built, not run (tests/cli/test_train.py runs `train` again and sees nothing traced).
    The schedule's settings are an input of the step (test_optim.py), not part of the
    combination; the optimizer's other settings are."""
    tcfg, _, dcfg, _, _, mesh = assets.tiny_target_and_draft(tmp_path)
    optim = OptimConfig(lr=1e-3, warmup_ratio=0.0, total_steps=10)
    cfg = ttt.TTTConfig(steps=2, compute_dtype=jnp.float32)
    first, second = (Trainer(tcfg, dcfg, cfg, optim, mesh) for _ in range(2))
    assert second._jitted is first._jitted
    for same in (dataclasses.replace(optim, lr=5e-4, warmup_ratio=0.1, min_lr_ratio=0.1),
                 dataclasses.replace(optim, total_steps=9)):
        assert Trainer(tcfg, dcfg, cfg, same, mesh)._jitted is first._jitted
    for other in (dataclasses.replace(optim, clip_norm=1.0), dataclasses.replace(optim, b2=0.9),
                  dataclasses.replace(optim, weight_decay=0.1)):
        assert Trainer(tcfg, dcfg, cfg, other, mesh)._jitted is not first._jitted
    assert Trainer(tcfg, dcfg, dataclasses.replace(cfg, steps=3), optim,
                   mesh)._jitted is not first._jitted


def test_the_trainer_gives_each_step_the_schedules_value_and_shares_one_program(tmp_path):
    """The LR is an input of the step (core/optim.py, test_optim.py): Trainer.lr(step) is the
    schedule's value at the state's step (the count it read inside the step: not one step
    early or late), the last one past the planned end; a Trainer with another --lr and
    --epochs has the same programs and its own values."""
    tcfg, _, dcfg, _, _, mesh = assets.tiny_target_and_draft(tmp_path)
    cfg = ttt.TTTConfig(steps=1, compute_dtype=jnp.float32)
    optim = OptimConfig(lr=3e-4, warmup_ratio=0.3, total_steps=10, min_lr_ratio=0.1)
    trainer = Trainer(tcfg, dcfg, cfg, optim, mesh)
    at = jax.jit(schedule(optim))
    steps = range(optim.total_steps + 3)
    assert [trainer.lr(s).item() for s in steps] == [
        at(np.int32(min(s, optim.total_steps))).item() for s in steps]
    other = Trainer(tcfg, dcfg, cfg, dataclasses.replace(optim, lr=5e-4, total_steps=9), mesh)
    assert other._jitted is trainer._jitted and other.lr(0) != trainer.lr(0)


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
