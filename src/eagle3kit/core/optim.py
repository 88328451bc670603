"""AdamW with linear warmup and cosine decay, global-norm clipping.

The config is plain data (optax is imported only to build the optimizer), so the command line
can read its defaults without loading JAX.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

if TYPE_CHECKING:
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


def make_optimizer(cfg: OptimConfig) -> optax.GradientTransformation:
    import optax

    return optax.chain(
        optax.clip_by_global_norm(cfg.clip_norm),
        optax.adamw(schedule(cfg), b1=cfg.b1, b2=cfg.b2, weight_decay=cfg.weight_decay),
    )
