"""AdamW with linear warmup and cosine decay, global-norm clipping.

The config is plain data (optax is imported only to build the optimizer), so the command line
can read its defaults without loading JAX.

The compiled train step takes each update's learning rate as an input (`step_lrs` holds the
schedule's values, computed once per run) rather than the schedule itself: its settings (`lr`,
`warmup_ratio`, `total_steps` from --epochs, `min_lr_ratio`) would be constants of the step's
program, so every run with other values compiled a train step of its own. One program now
serves them all (`program_key`); the optimizer state is the same as with the schedule inside
(optax's schedule count included), so checkpoints resume either way.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import numpy as np
    import optax


@dataclasses.dataclass(frozen=True)
class OptimConfig:
    lr: float = 3e-4
    warmup_ratio: float = 0.03
    total_steps: int = 1000  # the planned run; filled in by the train job
    min_lr_ratio: float = 0.0
    b1: float = 0.9
    b2: float = 0.95  # EAGLE's betas
    weight_decay: float = 0.0
    clip_norm: float = 0.5  # EAGLE and SpecForge clip at 0.5


# what only the schedule reads: not part of the compiled step (an input of it, per update)
SCHEDULE_FIELDS = ("lr", "warmup_ratio", "total_steps", "min_lr_ratio")


def schedule(cfg: OptimConfig) -> optax.Schedule:
    """LR of the update with optax count c (0-based), i.e. of step c + 1.

    Warmup rises linearly to `lr` over the first round(warmup_ratio * total) steps, then a
    cosine decays to `lr * min_lr_ratio` at the last step. Step n takes the value at n, not
    n - 1, so step 1 learns (optax's warmup starts at 0) and the last step ends the decay.
    """
    import optax

    total = max(cfg.total_steps, 1)
    warmup = min(int(round(cfg.warmup_ratio * total)), total - 1)
    base = optax.warmup_cosine_decay_schedule(
        init_value=0.0 if warmup else cfg.lr, peak_value=cfg.lr, warmup_steps=warmup,
        decay_steps=total, end_value=cfg.lr * cfg.min_lr_ratio)
    return lambda count: base(count + 1)


@functools.lru_cache(maxsize=8)  # per setting, for the runs of one process (tests, a sweep)
def step_lrs(cfg: OptimConfig) -> np.ndarray:
    """The schedule's float32 value for each count 0..total_steps; every later count takes the
    last (the decay has ended there: optax clamps the count).

    Computed by the schedule's own operations in one program on the default device, the counts
    passed in (as the step read them from its state): constant counts would let XLA evaluate
    the cosine at compile time, by other code than the device's, and the values could differ
    from those the schedule gave inside the step in the last bit.
    """
    import jax
    import numpy as np

    counts = np.arange(max(cfg.total_steps, 1) + 1, dtype=np.int32)
    lrs = np.array(jax.jit(schedule(cfg))(counts), np.float32)
    lrs.flags.writeable = False  # shared by the runs of this setting
    return lrs


def program_key(cfg: OptimConfig) -> OptimConfig:
    """`cfg` as the compiled step sees it: the schedule's settings left out."""
    return dataclasses.replace(cfg, **{f: OptimConfig.__dataclass_fields__[f].default
                                       for f in SCHEDULE_FIELDS})


def make_optimizer(cfg: OptimConfig, learning_rate: Callable | None = None
                   ) -> optax.GradientTransformation:
    """The optimizer of `cfg`; `learning_rate` (count -> lr) replaces its schedule: the train
    step passes one that returns its input, the state stays the same."""
    import optax

    return optax.chain(
        optax.clip_by_global_norm(cfg.clip_norm),
        optax.adamw(schedule(cfg) if learning_rate is None else learning_rate, b1=cfg.b1,
                    b2=cfg.b2, weight_decay=cfg.weight_decay),
    )
