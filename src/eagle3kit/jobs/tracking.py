"""Where a run's metrics go: OUT/metrics.jsonl always, and the trackers people watch.

`--track tensorboard` writes TensorBoard event files to OUT/tensorboard (through tensorboardX:
no TensorFlow or torch); `--track wandb` logs to Weights & Biases (WANDB_MODE=offline works
without network; `wandb sync` uploads later). Both are optional extras: `pip install
'eagle3kit[track]'` (tensorboardX) or `wandb`. Scalars are named loss, lr, grad_norm, tau,
acc/k, cond_acc/k, tokens_per_s, and eval/... for held-out evaluations, by optimizer step.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import msgspec

from eagle3kit.errors import UserError

TRACKERS = {"tensorboard": "tensorboardX", "wandb": "wandb"}  # --track name -> module


def parse_track(text: str | None) -> tuple[str, ...]:
    """`--track tensorboard,wandb` -> names, refused at once when unknown or not installed."""
    names = tuple(x.strip() for x in (text or "").split(",") if x.strip())
    for name in names:
        if name not in TRACKERS:
            raise UserError(f"--track {name!r}: choose {', '.join(TRACKERS)}")
        if importlib.util.find_spec(TRACKERS[name]) is None:
            extra = "'eagle3kit[track]'" if name == "tensorboard" else "wandb"
            raise UserError(f"--track {name} needs the {TRACKERS[name]} package: "
                            f"pip install {extra}")
    return names


class MetricsLog:
    """Appends records to metrics.jsonl and mirrors their numbers to the chosen trackers.

    `start_step`: a resumed run's step; TensorBoard drops events logged past it by the
    interrupted segment (they are re-run), as metrics.jsonl is cut back.
    """

    def __init__(self, out: Path, track: tuple[str, ...], config: dict[str, Any],
                 start_step: int):
        self._file = open(out / "metrics.jsonl", "a")
        self._tb = self._wandb = None
        if "tensorboard" in track:
            from tensorboardX import SummaryWriter

            self._tb = SummaryWriter(str(out / "tensorboard"),
                                     purge_step=start_step if start_step else None)
        if "wandb" in track:
            import wandb

            self._wandb = wandb.init(project="eagle3kit", name=out.name, dir=str(out),
                                     config=config, resume="allow", id=_run_id(out))

    def write(self, record: dict[str, Any]) -> None:
        self._file.write(msgspec.json.encode(record).decode() + "\n")
        self._file.flush()
        if self._tb is None and self._wandb is None:
            return
        scalars = scalars_of(record)
        if self._tb is not None:
            for name, value in scalars.items():
                self._tb.add_scalar(name, value, record["step"])
            self._tb.flush()
        if self._wandb is not None:
            self._wandb.log(scalars, step=record["step"])

    def close(self) -> None:
        self._file.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()


def scalars_of(record: dict[str, Any]) -> dict[str, float]:
    """A metrics record's numbers as tracker scalars (lists become name/k)."""
    prefix = "eval/" if record.get("eval") else ""
    out: dict[str, float] = {}
    for key, value in record.items():
        if key in ("step", "eval", "epoch"):
            continue
        if isinstance(value, list):
            out.update({f"{prefix}{key}/{k}": float(v) for k, v in enumerate(value)})
        elif isinstance(value, (int, float)):
            out[prefix + key] = float(value)
    return out


def _run_id(out: Path) -> str:
    """A stable W&B run id per run directory, so --resume continues the same W&B run."""
    path = out / "wandb-run-id"
    if not path.exists():
        import secrets

        path.write_text(secrets.token_hex(4) + "\n")
    return path.read_text().strip()
