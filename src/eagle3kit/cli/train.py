"""`eagle3kit train`: the sharded TTT trainer."""

from __future__ import annotations

from pathlib import Path

import typer

from eagle3kit.cli._common import (
    check_host_batch,
    check_output,
    console,
    example,
    handle_errors,
    no_stdout,
    require_files,
    styled,
)
from eagle3kit.cli._params import (
    Attention,
    Coordinator,
    Dtype,
    Mesh,
    NumProcesses,
    ProcessId,
    Seed,
    Target,
    TargetDtype,
)
from eagle3kit.core import arches
from eagle3kit.errors import UserError
from eagle3kit.jobs.config import TrainConfig, defaults
from eagle3kit.jobs.preempt import Preemption
from eagle3kit.jobs.tracking import parse_track

EXAMPLE = """
eagle3kit train --target HuggingFaceTB/SmolLM2-135M-Instruct --data train.jsonl \\
  --vocab vocab.safetensors --out runs/smollm2 --epochs 3 --batch-size 4 --seq-len 2048 \\
  --eval-data heldout.jsonl
eagle3kit train --target HuggingFaceTB/SmolLM2-135M-Instruct --data train.jsonl \\
  --vocab vocab.safetensors --out runs/smollm2-lk --loss lk-hybrid --position-weights verify
"""


D = defaults()


@handle_errors
def train(
    target: Target,
    data: Path = typer.Option(..., help="Token records from `eagle3kit tokenize` (JSONL)."),
    vocab: Path = typer.Option(..., help="Draft vocab from `eagle3kit vocab-select`."),
    out: Path = typer.Option(..., help="Run directory (checkpoints, metrics, final draft)."),
    eval_data: Path | None = typer.Option(None, help="Held-out token records to evaluate on."),
    ttt_length: int = typer.Option(D.ttt.steps, help="TTT steps K (draft tokens per rollout)."),
    decay: float = typer.Option(D.ttt.decay, help="Step weights' decay: step k weighs "
                                "decay**k (--position-weights geometric), or decays by it per "
                                "step after the first miss (verify)."),
    loss: str = typer.Option(D.ttt.loss, help="Loss per position between the target's "
                             "distribution p and the draft's q over the draft vocab: kl (soft "
                             "cross-entropy, EAGLE's), tv (1 - alpha, alpha = sum min(p, q) "
                             "the acceptance rate), nla (-log alpha), lk-hybrid (lambda KL + "
                             "(1 - lambda) TV, lambda = exp(-3 alpha)) or jsd (Jensen-Shannon). "
                             "See docs/losses.md."),
    position_weights: str = typer.Option(D.ttt.position_weights, help="Weight of TTT step k: "
                                         "geometric (decay**k) or verify (full weight up to "
                                         "each position's first draft miss, decayed after, "
                                         "rescaled to geometric's total)."),
    epochs: int = typer.Option(D.epochs, help="Passes over the data."),
    max_steps: int | None = typer.Option(None, help="Stop after this many steps (the LR "
                                         "schedule still spans --epochs; --resume with a "
                                         "larger value continues the same run)."),
    lr: float = typer.Option(D.optim.lr, help="Peak learning rate (AdamW)."),
    warmup_ratio: float = typer.Option(D.optim.warmup_ratio, help="Linear warmup share."),
    min_lr_ratio: float = typer.Option(D.optim.min_lr_ratio, help="Final LR as a share of "
                                       "--lr."),
    weight_decay: float = typer.Option(D.optim.weight_decay),
    clip_norm: float = typer.Option(D.optim.clip_norm, help="Global gradient-norm clip."),
    batch_size: int = typer.Option(D.batch_size, help="Packed rows per micro-batch (global, "
                                   "split over the data axis)."),
    seq_len: int = typer.Option(D.seq_len, help="Tokens per packed row (static shape)."),
    grad_accum: int = typer.Option(D.grad_accum, help="Micro-batches per optimizer step."),
    mesh: Mesh = D.mesh,
    dtype: Dtype = D.dtype,
    target_dtype: TargetDtype = D.target_dtype,
    attention: Attention = D.attention,
    aux_layers: str | None = typer.Option(None, help="Captured target layers as HF "
                                          "hidden_states indices, e.g. 2,15,27 "
                                          "(default 2,N//2,N-3)."),
    arch: str = typer.Option(D.arch, help=arches.help_text() + " Which engines serve each: "
                             "docs/serving.md."),
    block_size: int = typer.Option(D.block_size, help="DFlash: tokens per block (the anchor "
                                   "and block_size - 1 proposed in one pass)."),
    draft_layers: int = typer.Option(D.draft_layers, help="DFlash: decoder layers."),
    mask_token_id: int | None = typer.Option(None, help="DFlash: the token id filling a "
                                             "block after its anchor (default: the target "
                                             "vocabulary's last id)."),
    anchors: int = typer.Option(D.anchors, help="DFlash: blocks trained per row (0: "
                                "--seq-len // --block-size)."),
    init_from: str | None = typer.Option(None, help="Start from a draft (eagle3kit, SGLang "
                                         "or speculators format, directory or Hub id)."),
    resume: bool = typer.Option(False, help="Continue the run in --out from its last "
                                "checkpoint."),
    time_limit: float | None = typer.Option(None, help="Seconds of wall time; then "
                                            "checkpoint and exit 75 (resume with --resume), "
                                            "e.g. inside a batch job's time limit."),
    profile_steps: str | None = typer.Option(None, help="Trace steps A:B (A included, B not) "
                                             "with the JAX profiler into OUT/profile, for "
                                             "TensorBoard or Perfetto, e.g. 10:13."),
    save_every: int = typer.Option(D.save_every, help="Checkpoint every N steps."),
    keep_checkpoints: int = typer.Option(D.keep_checkpoints, help="Checkpoints kept on disk."),
    eval_every: int = typer.Option(D.eval_every, help="Evaluate --eval-data every N steps."),
    log_every: int = typer.Option(D.log_every, help="Log line every N steps (non-terminal)."),
    seed: Seed = D.seed,
    track: str | None = typer.Option(None, help="Also log to run trackers: tensorboard "
                                     "(event files in OUT/tensorboard) and/or wandb, e.g. "
                                     "tensorboard,wandb (WANDB_MODE=offline works without "
                                     "network). Needs the `track` extra."),
    coordinator: Coordinator = None,
    num_processes: NumProcesses = None,
    process_id: ProcessId = None,
) -> None:
    """Train an EAGLE3 draft head with training-time test against a frozen target.

    Each step runs the target (frozen) on packed rows of --seq-len tokens, captures three
    hidden states, and trains the draft on a --ttt-length-step rollout. Checkpoints are
    atomic; --resume continues exactly where a run stopped. SIGTERM, SIGUSR1 or Ctrl-C
    (preemption, a batch scheduler, a spot VM) checkpoints at the next step boundary and
    exits 75, like --time-limit; a second Ctrl-C quits at once. The finished draft lands in OUT/final, the
    input of `eagle3kit eval` and `eagle3kit convert`.
    """
    options = dict(locals())  # every option, by name: the config takes them as they are
    multihost = [options.pop(k) for k in ("coordinator", "num_processes", "process_id")]
    options["aux_layer_ids"] = _parse_layers(options.pop("aux_layers"))
    options["track"] = parse_track(options["track"])
    options["profile_steps"] = _parse_steps(options["profile_steps"])
    cfg = TrainConfig.from_options(**options)  # validates every option, before any loading
    _check_processes(*multihost)
    check_host_batch(cfg.batch_size * cfg.grad_accum, cfg.seq_len,
                     f"--batch-size {cfg.batch_size} x --grad-accum {cfg.grad_accum}")
    no_stdout(out, "--out", "a run directory")
    require_files(data=data, vocab=vocab, eval_data=eval_data)
    if out.exists() and not out.is_dir():
        raise UserError("is a file; --out is a run directory (choose a new path, or an "
                        "existing run with --resume)", path=out)
    check_output(out, "--out", "dir")

    with Preemption(lambda text: console.print(styled(text, "yellow"))) as stop:
        from eagle3kit.jobs import common  # JAX loads here, under the signal handlers
        from eagle3kit.jobs.train import run

        common.init_distributed(*multihost)
        run(cfg, console, stop)


def _check_processes(coordinator: str | None, count: int | None, index: int | None) -> None:
    """Multi-host options that jax.distributed cannot start with, as one line each."""
    if count is not None and count < 1:
        raise UserError(f"--num-processes {count}: must be at least 1")
    if index is not None and not 0 <= index < (count or 1):
        raise UserError(f"--process-id {index}: must be in [0, --num-processes "
                        f"{count or 1})")
    if count is not None and count > 1 and not coordinator:
        raise UserError(f"--num-processes {count} needs --coordinator HOST:PORT (process 0's "
                        "address)")


def _parse_steps(text: str | None) -> tuple[int, int] | None:
    if not text:
        return None
    try:
        a, b = (int(x) for x in text.split(":"))
    except ValueError:
        a = b = -1
    if not 0 <= a < b:
        raise typer.BadParameter(f"{text!r}: expected A:B with 0 <= A < B, e.g. 10:13",
                                 param_hint="--profile-steps")
    return a, b


def _parse_layers(text: str | None) -> tuple[int, ...] | None:
    if not text:
        return None
    try:
        return tuple(int(x) for x in text.split(","))
    except ValueError:
        raise typer.BadParameter(f"{text!r}: expected integers like 2,15,27",
                                 param_hint="--aux-layers") from None


train.__doc__ = (train.__doc__ or "") + example(EXAMPLE)
