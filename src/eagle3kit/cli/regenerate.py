"""`eagle3kit regenerate`: the target rewrites every assistant turn of the training data."""

from __future__ import annotations

import typer

from eagle3kit.cli._common import check_output, console, example, handle_errors
from eagle3kit.cli._params import ChatTemplate, Mesh, Seed, Target, TargetDtype

EXAMPLE = """
eagle3kit mix sharegpt.json -n 2000 --seed 0 \\
  | eagle3kit regenerate --target meta-llama/Llama-3.1-8B-Instruct --max-new-tokens 1024 \\
      -o regenerated.jsonl
eagle3kit regenerate --target HuggingFaceTB/SmolLM2-135M-Instruct -i mixed.jsonl \\
  --temperature 0.7 --top-p 0.9 --samples 2 --on-repetition drop-answer -o regenerated.jsonl
eagle3kit regenerate --target HuggingFaceTB/SmolLM2-135M-Instruct -i mixed.jsonl \\
  -o regenerated.jsonl --resume
eagle3kit regenerate --target Qwen/Qwen3-8B --no-thinking --endpoint http://127.0.0.1:30000 \\
  --concurrency 64 -i mixed.jsonl -o regenerated.jsonl
"""


@handle_errors
def regenerate(
    target: Target,
    input: str = typer.Option("-", "-i", "--input", help="Chat records (JSONL, from `mix`); "
                              "'-' = stdin."),
    out: str = typer.Option("-", "-o", "--out", help="Regenerated chat records (JSONL, what "
                            "`tokenize` reads); '-' = stdout. Written as conversations finish, "
                            "in input order, to FILE.partial, renamed to FILE when complete."),
    temperature: float = typer.Option(0.0, help="0 is greedy (what the peers recommend for "
                                      "draft data from 8B targets); above 0, sampling. Small "
                                      "targets whose greedy answers loop (SmolLM2-135M): 0.7 "
                                      "with --top-p 0.9."),
    top_p: float = typer.Option(1.0, "--top-p", help="Sampling: keep the smallest set of "
                                "tokens holding this much probability."),
    top_k: int = typer.Option(0, "--top-k", help="Sampling: keep only the K most probable "
                              "tokens (before --top-p); 0 keeps all."),
    samples: int = typer.Option(1, "--samples", max=1024, help="Answers per conversation (needs "
                                "--temperature > 0), each from its own seed: records "
                                "ID#s0..ID#s<N-1> follow each other (one: the input's id)."),
    seed: Seed = 0,
    max_new_tokens: int = typer.Option(2048, "--max-new-tokens", help="Longest answer; a "
                                       "longer one is cut, kept and marked 'length'."),
    max_context: int | None = typer.Option(None, "--max-context", help="Longest prompt + "
                                           "answer (default: 4096, or the target's positions "
                                           "if fewer). A turn whose prompt does not fit ends "
                                           "the conversation there."),
    turns: str = typer.Option("all", help="all: every assistant turn, each seeing the "
                              "regenerated earlier ones; first: only the first, the rest of "
                              "the conversation dropped."),
    thinking: bool | None = typer.Option(None, "--thinking/--no-thinking", help="Qwen3-style "
                                         "templates: generate in thinking or non-thinking "
                                         "mode (use the mode you will serve). Default: the "
                                         "template's."),
    chat_template: ChatTemplate = None,
    drop_truncated: bool = typer.Option(False, "--drop-truncated", help="Drop a conversation "
                                        "when one of its answers was cut at the token limit "
                                        "(counted either way)."),
    repeat_copies: int = typer.Option(3, "--repeat-copies", help="Local engine: end an answer "
                                      "whose last tokens are this many back-to-back copies "
                                      "of one block (finish reason 'repetition'); 0: never."),
    repeat_min_tokens: int = typer.Option(64, "--repeat-min-tokens", help="...when the "
                                          "copies span at least this many tokens (a short "
                                          "block needs more copies)."),
    repeat_max_block: int = typer.Option(128, "--repeat-max-block", help="...and the block "
                                         "is at most this many tokens."),
    on_repetition: str = typer.Option("keep", "--on-repetition", help="keep: the answer "
                                      "as ended; drop-answer: end the conversation before "
                                      "it; drop-conversation: drop the whole conversation "
                                      "(counted either way)."),
    limit: int | None = typer.Option(None, min=1, help="Only the first N conversations."),
    shard: str | None = typer.Option(None, help="I/N: this process takes the I-th of N "
                                     "contiguous blocks of the input (one per host); `cat` "
                                     "of the N outputs in order is the whole run."),
    resume: bool = typer.Option(False, "--resume", help="Continue -o FILE (its .partial "
                                "file): skip the conversations already in it (a torn last line is repaired)."),
    force: bool = typer.Option(False, "--force", help="Start -o FILE over if it exists."),
    slots: int = typer.Option(64, min=1, help="Local engine: conversations decoded at once "
                              "(KV cache rows); freed rows are refilled at once."),
    sync_every: int = typer.Option(32, "--sync-every", min=1, help="Local engine: decoding "
                                   "steps per device program between host syncs."),
    mixed_budget: int = typer.Option(0, "--mixed-budget", min=0, help="Local engine: "
                                     "prompt tokens each decoding step carries beside its "
                                     "rows (pieces of 64), so refills never stall the rows "
                                     "that decode; 0: prompts are prefilled apart (e.g. "
                                     "512; one process per GPU)."),
    mesh: Mesh = None,
    target_dtype: TargetDtype = "bfloat16",
    kv_attention: str = typer.Option("auto", "--kv-attention", help="Local engine: how "
                                     "decoding reads the KV cache: pallas (a GPU kernel "
                                     "reading each row in place to its own length; one "
                                     "device per process), xla (each step's window of "
                                     "every row), or auto: pallas on one GPU, else xla."),
    endpoint: str | None = typer.Option(None, help="Generate through an OpenAI-compatible "
                                        "server (vLLM, SGLang) at this base URL instead of "
                                        "loading the target here."),
    model: str | None = typer.Option(None, help="--endpoint: the model name to ask for "
                                     "(default: the server's first model; --target names the "
                                     "run in the records when the server lists none)."),
    concurrency: int = typer.Option(16, min=1, help="--endpoint: conversations in flight."),
    timeout: float = typer.Option(600.0, min=1.0, max=86400.0, help="--endpoint: seconds per request."),
    retries: int = typer.Option(5, min=0, help="--endpoint: retries of a failed request "
                                "(with backoff) before giving up on the run."),
) -> None:
    """Rewrite every assistant turn of a conversation file with the target's own answers.

    A draft learns to predict its target, so it trains best on the target's own text. Each
    assistant turn is replaced, in order, by the target's answer to the conversation so far
    (system and user turns kept; later turns see the regenerated earlier answers). Output
    records keep the `mix` schema, so `tokenize` reads them unchanged, and say how they were
    made (target digest, sampling settings, finish reason and size of every turn).

    Generation runs on a batched engine here (continuous refill of --slots rows), or on an
    OpenAI-compatible server with --endpoint. Records are written as conversations finish;
    until all are done they are in FILE.partial (FILE appears complete or not at
    all); after a kill, --resume continues; SIGINT/SIGTERM/SIGUSR1 stop cleanly with exit 75.

    Small targets loop: the local engine ends an answer whose tail repeats one block
    (--repeat-*, finish reason 'repetition'); sample them (--temperature, --top-p, --top-k)
    and take several answers per conversation (--samples) to scale the data.
    """
    from eagle3kit.jobs.regenerate import RegenerateConfig, run

    check_output(out, "-o", inputs={"-i": input})

    cfg = RegenerateConfig(
        target=target, input=input, out=out, temperature=temperature, top_p=top_p, top_k=top_k,
        samples=samples, seed=seed, max_new_tokens=max_new_tokens, max_context=max_context,
        turns=turns, thinking=thinking, chat_template=chat_template,
        drop_truncated=drop_truncated, repeat_copies=repeat_copies,
        repeat_min_tokens=repeat_min_tokens, repeat_max_block=repeat_max_block,
        on_repetition=on_repetition, limit=limit, shard=shard, resume=resume, force=force, slots=slots,
        sync_every=sync_every, mixed_budget=mixed_budget, mesh=mesh, target_dtype=target_dtype,
        kv_attention=kv_attention, endpoint=endpoint,
        model=model, concurrency=concurrency, timeout=timeout, retries=retries)
    run(cfg, console)


regenerate.__doc__ = (regenerate.__doc__ or "") + example(EXAMPLE)
