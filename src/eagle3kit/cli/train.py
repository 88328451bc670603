"""`eagle3kit train`: the sharded TTT trainer."""

from __future__ import annotations

from pathlib import Path

import typer

from eagle3kit.cli._common import console, example, handle_errors, require_files

EXAMPLE = """
eagle3kit train --target HuggingFaceTB/SmolLM2-135M-Instruct --data train.jsonl \\
  --vocab vocab.safetensors --out runs/smollm2 --epochs 3 --batch-size 4 --seq-len 2048 \\
  --eval-data heldout.jsonl
"""


@handle_errors
def train(
    target: str = typer.Option(..., help="Target model: HF directory, .gguf file or Hub id."),
    data: Path = typer.Option(..., help="Token records from `eagle3kit tokenize` (JSONL)."),
    vocab: Path = typer.Option(..., help="Draft vocab from `eagle3kit vocab-select`."),
    out: Path = typer.Option(..., help="Run directory (checkpoints, metrics, final draft)."),
    eval_data: Path | None = typer.Option(None, help="Held-out token records to evaluate on."),
    ttt_length: int = typer.Option(7, min=1, help="TTT steps K (draft tokens per rollout)."),
    decay: float = typer.Option(0.8, help="Loss weight of step k is decay**k."),
    epochs: int = typer.Option(3, min=1, help="Passes over the data."),
    max_steps: int | None = typer.Option(None, min=1, help="Stop after this many steps (the "
                                         "LR schedule still spans --epochs; --resume with a "
                                         "larger value continues the same run)."),
    lr: float = typer.Option(3e-4, help="Peak learning rate (AdamW)."),
    warmup_ratio: float = typer.Option(0.03, min=0.0, max=1.0, help="Linear warmup share."),
    min_lr_ratio: float = typer.Option(0.0, min=0.0, help="Final LR as a share of --lr."),
    weight_decay: float = typer.Option(0.0, min=0.0),
    clip_norm: float = typer.Option(0.5, help="Global gradient-norm clip."),
    batch_size: int = typer.Option(4, min=1, help="Packed rows per micro-batch (global, "
                                   "split over the data axis)."),
    seq_len: int = typer.Option(2048, min=16, help="Tokens per packed row (static shape)."),
    grad_accum: int = typer.Option(1, min=1, help="Micro-batches per optimizer step."),
    mesh: str | None = typer.Option(None, help="Device mesh, e.g. data=4,tensor=2 "
                                    "(default: every device on data)."),
    dtype: str = typer.Option("bfloat16", help="Draft compute dtype: bfloat16 or float32 "
                              "(master weights and optimizer state are float32)."),
    target_dtype: str = typer.Option("bfloat16", help="Target weights: bfloat16 or float32."),
    attention: str = typer.Option("auto", help="Target attention kernel: auto (cuDNN flash "
                                  "attention on GPUs in bf16), xla or cudnn."),
    aux_layers: str | None = typer.Option(None, help="Captured target layers as HF "
                                          "hidden_states indices, e.g. 2,15,27 "
                                          "(default 2,N//2,N-3)."),
    init_from: str | None = typer.Option(None, help="Start from a draft (eagle3kit, SGLang "
                                         "or speculators format, directory or Hub id)."),
    resume: bool = typer.Option(False, help="Continue the run in --out from its last "
                                "checkpoint."),
    time_limit: float | None = typer.Option(None, min=1, help="Seconds of wall time; then "
                                            "checkpoint and exit 75 (resume with --resume), "
                                            "e.g. inside a batch job's time limit."),
    save_every: int = typer.Option(500, min=1, help="Checkpoint every N steps."),
    keep_checkpoints: int = typer.Option(2, min=1, help="Checkpoints kept on disk."),
    eval_every: int = typer.Option(500, min=1, help="Evaluate --eval-data every N steps."),
    log_every: int = typer.Option(10, min=1, help="Log line every N steps (non-terminal)."),
    seed: int = typer.Option(0, help="Seed of the draft init and the data order."),
    coordinator: str | None = typer.Option(None, help="Multi-host: coordinator HOST:PORT."),
    num_processes: int | None = typer.Option(None, help="Multi-host: number of processes."),
    process_id: int | None = typer.Option(None, help="Multi-host: this process's index."),
) -> None:
    """Train an EAGLE3 draft head with training-time test against a frozen target.

    Each step runs the target (frozen) on packed rows of --seq-len tokens, captures three
    hidden states, and trains the draft on a --ttt-length-step rollout. Checkpoints are
    atomic; --resume continues exactly where a run stopped. The finished draft lands in
    OUT/final, the input of `eagle3kit eval` and `eagle3kit convert`.
    """
    from eagle3kit.jobs import common
    from eagle3kit.jobs.common import DTYPES
    from eagle3kit.jobs.train import TrainConfig, run

    require_files(data=data, vocab=vocab, eval_data=eval_data)
    for name, value in (("--dtype", dtype), ("--target-dtype", target_dtype)):
        if value not in DTYPES:
            raise typer.BadParameter(f"{value!r}; choose {' or '.join(DTYPES)}", param_hint=name)
    if attention not in ("auto", "xla", "cudnn"):
        raise typer.BadParameter(f"{attention!r}; choose auto, xla or cudnn",
                                 param_hint="--attention")
    common.init_distributed(coordinator, num_processes, process_id)
    cfg = TrainConfig(
        target=target, data=str(data), vocab=str(vocab), out=str(out),
        eval_data=str(eval_data) if eval_data else None, ttt_length=ttt_length, decay=decay,
        epochs=epochs, max_steps=max_steps, lr=lr, warmup_ratio=warmup_ratio,
        min_lr_ratio=min_lr_ratio, weight_decay=weight_decay, clip_norm=clip_norm,
        batch_size=batch_size, seq_len=seq_len, grad_accum=grad_accum, mesh=mesh, dtype=dtype,
        target_dtype=target_dtype, attention=attention, seed=seed, save_every=save_every,
        keep_checkpoints=keep_checkpoints, eval_every=eval_every, log_every=log_every,
        aux_layer_ids=_parse_layers(aux_layers), init_from=init_from, resume=resume,
        time_limit=time_limit)
    run(cfg, console)


def _parse_layers(text: str | None) -> tuple[int, ...] | None:
    if not text:
        return None
    try:
        return tuple(int(x) for x in text.split(","))
    except ValueError:
        raise typer.BadParameter(f"{text!r}: expected integers like 2,15,27",
                                 param_hint="--aux-layers") from None


train.__doc__ = (train.__doc__ or "") + example(EXAMPLE)
