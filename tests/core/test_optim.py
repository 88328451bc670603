"""The learning rate as an input of the train step (core/optim.py): the values the step is
given are the schedule's, bit for bit, and an update with them is the update the schedule
gave inside the step, so runs train exactly as when the schedule was compiled in (the
Trainer's share of it, and its programs shared by runs that differ only in the schedule's
settings: test_shared_programs.py)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from eagle3kit.core.optim import OptimConfig, make_optimizer, schedule, step_lrs

CONFIGS = [OptimConfig(lr=1e-3, total_steps=9),  # rounds to no warmup: a cosine from step 1
           OptimConfig(lr=3e-4, warmup_ratio=0.3, total_steps=10, min_lr_ratio=0.1),
           OptimConfig(lr=2e-3, warmup_ratio=0.5, total_steps=2, min_lr_ratio=0.5)]


@pytest.mark.parametrize("cfg", CONFIGS)
def test_step_lrs_are_the_schedules_values_as_the_step_computed_them(cfg):
    lrs = step_lrs(cfg)
    at = jax.jit(schedule(cfg))  # a scalar count, as the step read it from its state
    assert lrs.dtype == np.float32 and len(lrs) == cfg.total_steps + 1
    assert [at(np.int32(c)).item() for c in range(len(lrs))] == lrs.tolist()
    # the decay has ended at the last planned step: what a count past it is given
    assert lrs[-1] == lrs[-2] == pytest.approx(cfg.lr * cfg.min_lr_ratio, rel=1e-6)


def test_an_update_given_its_lr_is_the_update_of_the_schedule_inside():
    cfg = CONFIGS[1]
    rng = np.random.default_rng(0)
    params = {"w": jnp.asarray(rng.standard_normal((5, 3)), jnp.float32),
              "b": jnp.asarray(rng.standard_normal(3), jnp.float32)}
    inside = make_optimizer(cfg)

    @jax.jit
    def old(params, state, grads):
        updates, state = inside.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    @jax.jit
    def new(params, state, grads, lr):  # another run's settings: only the LR given counts
        tx = make_optimizer(CONFIGS[0], lambda _: lr)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    a, b = params, params
    sa, sb = inside.init(a), make_optimizer(cfg, lambda _: 0.0).init(b)
    assert jax.tree.structure(sa) == jax.tree.structure(sb)  # checkpoints resume either way
    lrs = step_lrs(cfg)
    for c in range(cfg.total_steps + 2):  # past the end: the last value
        grads = jax.tree.map(lambda x: jnp.asarray(rng.standard_normal(x.shape), x.dtype), a)
        a, sa = old(a, sa, grads)
        b, sb = new(b, sb, grads, lrs[min(c, len(lrs) - 1)])
        for x, y in zip(jax.tree.leaves((a, sa)), jax.tree.leaves((b, sb)), strict=True):
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
