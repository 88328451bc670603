"""The train job's configuration: one typed, nested source of truth, validated once.

`eagle3kit train` reads its defaults from here and fills `TrainConfig` through
`from_options` (option names in, nested parts out), so no option is copied by hand and no
default is written twice. The run directory records the configuration flat, under the option
names (`to_json`): `--resume` compares it key by key and names the option that changed, and
the model card reads the same keys from a draft's `training` record.

No JAX here: the command line imports this module before any device work.
"""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Any

from eagle3kit.core import arches, train_attention
from eagle3kit.core.optim import OptimConfig
from eagle3kit.errors import UserError
from eagle3kit.io import dtypes

COMPUTE_DTYPES = dtypes.COMPUTE  # names of --dtype / --target-dtype
ATTENTION = train_attention.CHOICES  # --attention's (resolved by core/train_attention.py)
LOSSES = ("kl", "tv", "nla", "lk-hybrid", "jsd")  # --loss (core/losses.py, docs/losses.md)
POSITION_WEIGHTS = ("geometric", "verify")  # --position-weights (core/losses.py)


@dataclasses.dataclass(frozen=True)
class TTTSettings:
    """Training-time test: K draft steps per rollout, the loss per position, and the weight
    of step k (geometric: decay**k; verify: decay after the first miss, docs/losses.md)."""

    steps: int = 7  # K (--ttt-length); also `eval --steps` for drafts that do not record it
    decay: float = 0.8
    loss: str = "kl"
    position_weights: str = "geometric"


# flat option name -> (part, field) of the nested parts; every other option is a top field
_NESTED = {"ttt_length": ("ttt", "steps"), "decay": ("ttt", "decay"), "loss": ("ttt", "loss"),
           "position_weights": ("ttt", "position_weights"),
           **{f.name: ("optim", f.name) for f in dataclasses.fields(OptimConfig)
              if f.name != "total_steps"}}  # total_steps is derived from the data


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    target: str
    data: str
    vocab: str
    out: str
    eval_data: str | None = None
    ttt: TTTSettings = dataclasses.field(default_factory=TTTSettings)
    optim: OptimConfig = dataclasses.field(default_factory=OptimConfig)
    epochs: int = 3
    max_steps: int | None = None  # stops early; the LR schedule still spans --epochs
    batch_size: int = 4  # packed rows per micro-batch, global
    seq_len: int = 2048
    grad_accum: int = 1
    mesh: str | None = None
    dtype: str = "bfloat16"  # draft compute dtype (master weights stay float32)
    target_dtype: str = "bfloat16"
    attention: str = "auto"
    seed: int = 0
    save_every: int = 500
    keep_checkpoints: int = 2
    eval_every: int = 500
    log_every: int = 10
    aux_layer_ids: tuple[int, ...] | None = None
    arch: str = "eagle3"  # a registered architecture (core/arches.py)
    # parallel drafters (DFlash): tokens per block, decoder layers, the id filling a block
    # after its anchor (None: the target vocabulary's last id), blocks per row (0: seq_len //
    # block_size)
    block_size: int = 8
    draft_layers: int = 1
    mask_token_id: int | None = None
    anchors: int = 0
    init_from: str | None = None
    resume: bool = False
    time_limit: float | None = None  # seconds; then checkpoint and exit 75 (resumable)
    track: tuple[str, ...] = ()  # run trackers: "tensorboard", "wandb" (jobs/tracking.py)
    profile_steps: tuple[int, int] | None = None  # trace steps [A, B) into OUT/profile

    def __post_init__(self) -> None:
        _validate(self)

    @classmethod
    def from_options(cls, **options: Any) -> TrainConfig:
        """From flat option values (`lr=..., ttt_length=...`); paths become strings."""
        parts: dict[str, dict[str, Any]] = {"ttt": {}, "optim": {}}
        top: dict[str, Any] = {}
        for name, value in options.items():
            if isinstance(value, os.PathLike):
                value = os.fspath(value)
            if name in _NESTED:
                part, field = _NESTED[name]
                parts[part][field] = value
            else:
                top[name] = value
        return cls(**top, ttt=TTTSettings(**parts["ttt"]), optim=OptimConfig(**parts["optim"]))

    def to_json(self) -> dict[str, Any]:
        """Flat, under the option names (what config.json and a draft's `training` record)."""
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
             if f.name not in ("ttt", "optim")}
        for name, (part, field) in _NESTED.items():
            d[name] = getattr(getattr(self, part), field)
        d["aux_layer_ids"] = list(self.aux_layer_ids) if self.aux_layer_ids else None
        return d


def defaults() -> TrainConfig:
    """The defaults, for the command line's help (paths left empty)."""
    return TrainConfig("", "", "", "")


def _validate(c: TrainConfig) -> None:
    """Every option a run cannot start with, refused before anything is loaded."""
    o, t = c.optim, c.ttt
    positive = {"--lr": o.lr, "--clip-norm": o.clip_norm}
    for name, value in positive.items():
        if not (math.isfinite(value) and value > 0):
            raise UserError(f"{name} {value:g}: must be a positive number")
    at_least_one = {"--ttt-length": t.steps, "--epochs": c.epochs, "--batch-size": c.batch_size,
                    "--grad-accum": c.grad_accum, "--save-every": c.save_every,
                    "--keep-checkpoints": c.keep_checkpoints, "--eval-every": c.eval_every,
                    "--log-every": c.log_every, "--draft-layers": c.draft_layers,
                    "--max-steps": 1 if c.max_steps is None else c.max_steps}
    for name, value in at_least_one.items():
        if value < 1:
            raise UserError(f"{name} {value}: must be at least 1")
    if not 0 < t.decay <= 1:  # above 1 the later steps' weights grow past float32's range
        raise UserError(f"--decay {t.decay:g}: must be in (0, 1]")
    if c.block_size < 2:
        raise UserError(f"--block-size {c.block_size}: must be at least 2 (the anchor and one "
                        "proposed token)")
    if c.block_size >= c.seq_len:
        raise UserError(f"--block-size {c.block_size}: must be less than --seq-len "
                        f"{c.seq_len} (anchors come before a row's last block)")
    for name, value in (("--anchors", c.anchors), ("--mask-token-id", c.mask_token_id)):
        if value is not None and value < 0:
            raise UserError(f"{name} {value}: must not be negative")
    if c.seq_len < 16:
        raise UserError(f"--seq-len {c.seq_len}: must be at least 16")
    if not 0 <= o.warmup_ratio < 1:
        raise UserError(f"--warmup-ratio {o.warmup_ratio:g}: must be in [0, 1)")
    if not 0 <= o.min_lr_ratio <= 1:
        raise UserError(f"--min-lr-ratio {o.min_lr_ratio:g}: must be in [0, 1]")
    if not o.weight_decay >= 0:
        raise UserError(f"--weight-decay {o.weight_decay:g}: must be >= 0")
    if not (0 <= o.b1 < 1 and 0 <= o.b2 < 1):
        raise UserError(f"AdamW betas ({o.b1:g}, {o.b2:g}) must be in [0, 1)")
    if c.time_limit is not None and not c.time_limit > 0:
        raise UserError(f"--time-limit {c.time_limit:g}: must be a positive number of seconds")
    for name, value in (("--dtype", c.dtype), ("--target-dtype", c.target_dtype)):
        if value not in COMPUTE_DTYPES:  # the command line canonicalises aliases (bf16)
            dtypes.dtype_name(value, COMPUTE_DTYPES, name)
    for name, value, choices in (("--arch", c.arch, arches.names()),
                                 ("--attention", c.attention, ATTENTION),
                                 ("--loss", t.loss, LOSSES),
                                 ("--position-weights", t.position_weights, POSITION_WEIGHTS)):
        if value not in choices:
            raise UserError(f"{name} {value!r}: choose {', '.join(choices)}")
