"""Where a run's metrics go: OUT/metrics.jsonl always, and the trackers people watch.

`--track tensorboard` writes TensorBoard event files to OUT/tensorboard (through tensorboardX:
no TensorFlow or torch); `--track wandb` logs to Weights & Biases (WANDB_MODE=offline works
without network; `wandb sync` uploads later). Both are optional extras: `pip install
'eagle3kit[track]'`. Scalars are named loss, lr, grad_norm, tau, acc/k, cond_acc/k,
tokens_per_s, and eval/... for held-out evaluations, by optimizer step.

`eval --track` logs its result into the same places of the training run (the draft's run
directory, or --track-dir): eval/DATASET/NAME scalars at the step the draft was trained to,
so an evaluation of runs/x/final shows up beside runs/x's training curves; in W&B as its own
run of job type `eval`, grouped with the training run.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import re
from pathlib import Path
from typing import Any

import msgspec

from eagle3kit.errors import UserError

TRACKERS = {"tensorboard": "tensorboardX", "wandb": "wandb"}  # --track name -> module
# eval result keys that are settings, not measurements: W&B config, not scalars
EVAL_SETTINGS = ("steps", "topk", "draft_tokens", "temperature", "max_new_tokens")


def parse_track(text: str | None) -> tuple[str, ...]:
    """`--track tensorboard,wandb` -> names, refused at once when unknown or not installed."""
    names = tuple(x.strip() for x in (text or "").split(",") if x.strip())
    for name in names:
        if name not in TRACKERS:
            raise UserError(f"--track {name!r}: choose {', '.join(TRACKERS)}")
        if importlib.util.find_spec(TRACKERS[name]) is None:
            raise UserError(f"--track {name} needs the {TRACKERS[name]} package: "
                            "pip install 'eagle3kit[track]'")
    return names


class Trackers:
    """The TensorBoard and W&B writers of one run directory (`out`).

    `purge_step`: TensorBoard drops events an interrupted segment logged from there on.
    `wandb_args`: wandb.init's name, id, resume, group, job_type, config.
    """

    def __init__(self, out: Path, track: tuple[str, ...], *, purge_step: int | None = None,
                 **wandb_args: Any):
        self._tb = self._wandb = None
        if "tensorboard" in track:
            from tensorboardX import SummaryWriter

            self._tb = SummaryWriter(str(out / "tensorboard"), purge_step=purge_step)
        if "wandb" in track:
            import wandb

            self._wandb = wandb.init(project="eagle3kit", dir=str(out), **wandb_args)

    def __bool__(self) -> bool:
        return self._tb is not None or self._wandb is not None

    def log(self, scalars: dict[str, float], step: int) -> None:
        if self._tb is not None:
            for name, value in scalars.items():
                self._tb.add_scalar(name, value, step)
            self._tb.flush()
        if self._wandb is not None:
            self._wandb.log(scalars, step=step)

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()


class MetricsLog:
    """Appends records to metrics.jsonl and mirrors their numbers to the chosen trackers.

    `start_step`: a resumed run's step; TensorBoard drops events logged past it by the
    interrupted segment (they are re-run), as metrics.jsonl is cut back.
    """

    def __init__(self, out: Path, track: tuple[str, ...], config: dict[str, Any],
                 start_step: int):
        self._file = open(out / "metrics.jsonl", "a")
        self._trackers = Trackers(
            out, track, purge_step=start_step or None, name=out.name, group=out.name,
            job_type="train", config=config, resume="allow", id=_run_id(out) if "wandb" in track else None)

    def write(self, record: dict[str, Any]) -> None:
        self._file.write(msgspec.json.encode(record).decode() + "\n")
        self._file.flush()
        if self._trackers:
            self._trackers.log(scalars_of(record), record["step"])

    def close(self) -> None:
        self._file.close()
        self._trackers.close()


def scalars_of(record: dict[str, Any]) -> dict[str, float]:
    """A metrics record's numbers as tracker scalars (lists become name/k)."""
    prefix = "eval/" if record.get("eval") else ""
    out: dict[str, float] = {}
    for key, value in record.items():
        if key in ("step", "eval", "epoch"):
            continue
        if isinstance(value, list):
            out.update({f"{prefix}{key}/{k}": float(v) for k, v in enumerate(value)})
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            out[prefix + key] = float(value)
    return out


@dataclasses.dataclass(frozen=True)
class EvalTracking:
    """Where and at which step `eval --track` logs: a run directory and the draft's step."""

    track: tuple[str, ...]
    directory: Path
    step: int


def eval_tracking(track: str | None, track_dir: Path | None,
                  draft: str) -> EvalTracking | None:
    """`eval --track/--track-dir`, resolved before any work. By default the run directory
    holding the draft (runs/x for runs/x/final: it has metrics.jsonl); the step is the one
    the draft's training record reached (0 for drafts trained elsewhere)."""
    names = parse_track(track)
    if not names:
        if track_dir is not None:
            raise UserError("--track-dir names where --track logs; add --track tensorboard "
                            "and/or wandb")
        return None
    draft_dir = Path(os.path.abspath(draft))  # `--draft .` inside runs/x/final too
    if track_dir is None:
        if not (draft_dir.parent / "metrics.jsonl").is_file():
            raise UserError(f"--track: {draft} is not inside a training run directory (no "
                            "metrics.jsonl beside it); name one with --track-dir")
        track_dir = draft_dir.parent
    if track_dir.exists() and not track_dir.is_dir():
        raise UserError("is a file; --track-dir is a run directory", path=track_dir)
    return EvalTracking(names, track_dir, _trained_step(draft_dir))


def log_eval(tracking: EvalTracking, result: dict[str, Any]) -> None:
    """`eval`'s result as eval/DATASET/NAME scalars at the draft's step (see the module)."""
    dataset = re.sub(r"[^\w.-]+", "_", Path(str(result["dataset"])).stem).strip("_")
    settings = {k: result[k] for k in EVAL_SETTINGS if k in result}
    measured = {k: v for k, v in result.items() if k not in EVAL_SETTINGS}
    scalars = {f"eval/{dataset}/{k}": v for k, v in scalars_of(measured).items()}
    out = tracking.directory
    out.mkdir(parents=True, exist_ok=True)
    trackers = Trackers(out, tracking.track, name=f"{out.name}-eval-{dataset}", group=out.name,
                        job_type="eval", config={**settings, "draft": result.get("draft"),
                                                 "mode": result.get("mode"),
                                                 "dataset": result["dataset"]})
    try:
        trackers.log(scalars, tracking.step)
    finally:
        trackers.close()


def _trained_step(draft_dir: Path) -> int:
    """The optimizer step an eagle3kit draft was trained to (draft_config.json's training
    record); drafts from elsewhere, and Hub ids, have none: 0."""
    from eagle3kit.io.draft_io import CONFIG

    try:
        meta = json.loads((draft_dir / CONFIG).read_text())
    except (OSError, ValueError):
        return 0
    return int((meta.get("training") or {}).get("steps") or 0)


def _run_id(out: Path) -> str:
    """A stable W&B run id per run directory, so --resume continues the same W&B run."""
    path = out / "wandb-run-id"
    if not path.exists():
        import secrets

        path.write_text(secrets.token_hex(4) + "\n")
    return path.read_text().strip()
