"""AdamW with linear warmup and cosine decay, global-norm clipping."""

from __future__ import annotations

import dataclasses

import optax


@dataclasses.dataclass(frozen=True)
class OptimConfig:
    lr: float = 3e-4
    warmup_ratio: float = 0.03
    total_steps: int = 1000
    min_lr_ratio: float = 0.0
    b1: float = 0.9
    b2: float = 0.95  # EAGLE's betas
    weight_decay: float = 0.0
    clip_norm: float = 0.5  # EAGLE and SpecForge clip at 0.5


def schedule(cfg: OptimConfig) -> optax.Schedule:
    total = max(cfg.total_steps, 1)
    warmup = min(int(round(cfg.warmup_ratio * total)), total - 1)
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0 if warmup else cfg.lr, peak_value=cfg.lr, warmup_steps=warmup,
        decay_steps=total, end_value=cfg.lr * cfg.min_lr_ratio)


def make_optimizer(cfg: OptimConfig) -> optax.GradientTransformation:
    return optax.chain(
        optax.clip_by_global_norm(cfg.clip_norm),
        optax.adamw(schedule(cfg), b1=cfg.b1, b2=cfg.b2, weight_decay=cfg.weight_decay),
    )
