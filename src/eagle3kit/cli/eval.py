"""`eagle3kit eval`: acceptance of a draft, teacher-forced or by real speculative decoding."""

from __future__ import annotations

import json
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
)
from eagle3kit.cli._params import (
    Attention,
    ChatTemplate,
    EvalDtype,
    Mesh,
    Seed,
    Target,
    TargetDtype,
)
from eagle3kit.jobs.config import TTTSettings
from eagle3kit.jobs.tracking import eval_tracking, log_eval

EXAMPLE = """
eagle3kit eval --target HuggingFaceTB/SmolLM2-135M-Instruct --draft runs/smollm2/final \\
  --data heldout.jsonl --json > evals.jsonl
eagle3kit eval --target HuggingFaceTB/SmolLM2-135M-Instruct --draft runs/smollm2/final \\
  --prompts mt-bench --steps 7 --max-new-tokens 256 --samples samples.jsonl \\
  --plot acceptance.png --json >> evals.jsonl
eagle3kit eval --target HuggingFaceTB/SmolLM2-135M-Instruct --draft runs/smollm2/final \\
  --prompts mt-bench --steps 5 --topk 4 --draft-tokens 8 --json >> evals.jsonl
eagle3kit eval --target HuggingFaceTB/SmolLM2-135M-Instruct --draft runs/smollm2/final \\
  --prompts mt-bench --steps 5 --topk 4 --draft-tokens 8 --temperature 0.7
eagle3kit eval --target HuggingFaceTB/SmolLM2-135M-Instruct --draft runs/smollm2/final \\
  --data heldout.jsonl --track tensorboard   # into runs/smollm2/tensorboard
eagle3kit eval --target HuggingFaceTB/SmolLM2-135M-Instruct --draft runs/smollm2/final \\
  --prompts mt-bench --concurrency 1,8,32 --sweep --json >> evals.jsonl
"""


@handle_errors
def eval_cmd(
    target: Target,
    draft: str = typer.Option(..., help="Draft: eagle3kit, SGLang or speculators format "
                              "(directory or Hub id)."),
    data: str | None = typer.Option(None, help="Token records (JSONL, - for stdin) scored "
                                    "teacher-forced."),
    prompts: str | None = typer.Option(None, help="Prompts to generate from: mt-bench, "
                                       "humaneval, or a JSONL file of conversations "
                                       "(- for stdin)."),
    mode: str | None = typer.Option(None, help="teacher-forced or generate (default: "
                                    "generate with --prompts, else teacher-forced)."),
    steps: int | None = typer.Option(None, min=1, max=64, help="Draft tokens per step (K) "
                                     "(default: the draft's trained --ttt-length, else "
                                     f"{TTTSettings().steps}; a P-EAGLE or DFlash draft: "
                                     "its block's proposals, at most those)."),
    topk: int = typer.Option(1, min=1, max=16, help="Generation: children of each expanded "
                             "tree node (SGLang's --speculative-eagle-topk; 1 is a chain); "
                             "--steps is then the tree's depth (--speculative-num-steps). "
                             "Trees verify greedily at --temperature 0, by tree speculative "
                             "sampling above it."),
    draft_tokens: int | None = typer.Option(None, min=2, max=1 + 64 * 16, help="Generation: tree nodes "
                                            "verified per step, the root included (SGLang's "
                                            "--speculative-num-draft-tokens; default steps "
                                            "+ 1, the chain)."),
    max_new_tokens: int = typer.Option(256, min=1, help="Generation: tokens per answer."),
    temperature: float = typer.Option(0.0, min=0.0, help="Generation: 0 is greedy "
                                      "(lossless); above 0, speculative sampling (chains "
                                      "and trees alike), distributed as the target's own "
                                      "sampling at that temperature."),
    limit: int | None = typer.Option(None, min=1, help="Generation: only the first N "
                                     "conversations of the prompt set."),
    samples: Path | None = typer.Option(None, help="Generation: write one JSONL record per "
                                        "answer (ids, text, accepted lengths)."),
    json_out: bool = typer.Option(False, "--json", help="Print the result as one JSON "
                                  "object on stdout."),
    plot: Path | None = typer.Option(None, help="Write a PNG of acceptance per position "
                                     "(needs the `plot` extra)."),
    concurrency: str | None = typer.Option(None, help="Generation: also decode the answered "
                                           "prompts B at a time for each batch size B of this "
                                           "list (e.g. 1,8,32,64), speculatively and plainly "
                                           "with continuous refill, and report the speedup "
                                           "at each."),
    sweep: bool = typer.Option(False, "--sweep", help="Generation: try every drafting shape "
                               "of --sweep-grid at the --concurrency batch sizes (default 1) "
                               "and name the fastest per batch size (for `push`)."),
    sweep_grid: str | None = typer.Option(None, help="Shapes for --sweep, ;-separated: K (a "
                                          "chain) or S/k/N (a tree of depth S, top-k, N "
                                          "tokens). Default: 3;5;7;3/4/8;5/4/8;5/8/16."),
    batch_size: int = typer.Option(8, min=1, help="Teacher-forced: packed rows per batch."),
    seq_len: int = typer.Option(2048, min=16, help="Teacher-forced: tokens per row."),
    mesh: Mesh = None,
    dtype: EvalDtype = "bfloat16",
    target_dtype: TargetDtype = "bfloat16",
    attention: Attention = "auto",
    seed: Seed = 0,
    thinking: bool | None = typer.Option(None, "--thinking/--no-thinking", help="Generation, "
                                         "Qwen3-style templates: render prompts in thinking or "
                                         "non-thinking mode (the mode you serve). Default: the "
                                         "template's."),
    chat_template: ChatTemplate = None,
    track: str | None = typer.Option(None, help="Also log the result to run trackers: "
                                     "tensorboard and/or wandb, as eval/DATASET/... scalars "
                                     "at the draft's training step (WANDB_MODE=offline works "
                                     "without network). Needs the `track` extra."),
    track_dir: Path | None = typer.Option(None, help="The run directory --track logs into "
                                          "(DIR/tensorboard, DIR/wandb). Default: the "
                                          "draft's training run, runs/x for runs/x/final."),
) -> None:
    """Measure how many tokens a draft gets accepted by its target.

    With --data, the trainer's own teacher-forced rollout gives acc_k (draft token k+1
    equals the target's greedy token), cond_acc_k (given tokens 1..k were right) and the
    estimated acceptance length tau. With --prompts, real speculative decoding runs on the
    device next to plain decoding of the same target: tau is tokens per target forward, and
    tokens/s of both give the speedup; the answers are then scored teacher-forced as well.
    A table goes to stderr; --json prints the result for `eagle3kit push`.
    """
    from eagle3kit.jobs.eval_report import plot_acceptance, print_report, require_matplotlib
    from eagle3kit.jobs.evaluate import EvalConfig, run

    require_files(data=data)
    if data is not None:  # teacher-forced: batches packed on the host
        check_host_batch(batch_size, seq_len, f"--batch-size {batch_size} x --seq-len {seq_len}")
    no_stdout(plot, "--plot", "a PNG")
    if samples is not None and str(samples) == "-" and json_out:
        raise typer.BadParameter("stdout carries the --json result; write samples to a file",
                                 param_hint="--samples")
    reads = {"--data": data, "--prompts": prompts}
    check_output(plot, "--plot", inputs=reads)  # before the work, not after an hour of decoding
    check_output(samples, "--samples", inputs={**reads, "--plot": plot})
    if plot is not None:
        require_matplotlib()
    tracking = eval_tracking(track, track_dir, draft)
    cfg = EvalConfig(
        target=target, draft=draft, data=data, prompts=prompts, mode=mode, steps=steps,
        topk=topk, draft_tokens=draft_tokens, max_new_tokens=max_new_tokens,
        temperature=temperature, limit=limit,
        batch_size=batch_size, seq_len=seq_len, mesh=mesh, dtype=dtype,
        target_dtype=target_dtype, attention=attention, seed=seed,
        samples=str(samples) if samples is not None else None, thinking=thinking,
        chat_template=chat_template,
        concurrency=concurrency, sweep=sweep, sweep_grid=sweep_grid)
    result = run(cfg, console)
    print_report(console, result)
    if tracking is not None:
        log_eval(tracking, result)
        console.print(f"logged to {', '.join(tracking.track)} in {tracking.directory} "
                      f"(step {tracking.step})")
    if plot is not None:
        plot_acceptance(result, plot)
        console.print(f"plot written to {plot}")
    if json_out:
        typer.echo(json.dumps(result))


eval_cmd.__doc__ = (eval_cmd.__doc__ or "") + example(EXAMPLE)
