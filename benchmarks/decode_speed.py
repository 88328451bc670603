"""Speculative vs plain decoding speed of a target/draft pair on a prompt set, per drafting shape.

For every shape in --steps (K: a chain of K draft tokens; S/k/N: SGLang's tree of depth S,
top-k expansion, N tokens verified with the root, as `eval --steps S --topk k --draft-tokens
N`), decodes every turn of the prompt set twice in one process: with the draft and plainly,
both by the one engine with one row (`eagle3kit.decode.engine`, as `eval --prompts`), each
answer timed on its own after a pass that compiles. Prints a
Markdown table: tau (tokens per target forward, pooled over verify steps and as the mean of
per-request taus, both with the bonus token), tokens/s of both, the speedup, how many greedy
answers were identical, compile time and peak device memory. `--draft random` measures the
overhead floor with an untrained draft (tau ~ 1), before any draft is trained.

`--concurrency 1,8,32,64` then decodes the answered prompts again at each batch size B, with
continuous refill, speculatively (every shape of --steps) and plainly, as `eval --concurrency
--sweep` does (jobs/eval_batched.py), and prints a second table and the fastest shape per B.

GPU (the numbers to report):

    python benchmarks/decode_speed.py --target meta-llama/Llama-3.1-8B-Instruct \\
        --draft runs/llama/final --prompts mt-bench --steps 3,5,7,5/4/8 --max-new-tokens 256 \\
        --concurrency 1,8,32,64

Where a step's time goes (draft, verify, host): `--profile DIR` traces one more pass of the
answered prompts at batch --profile-batch, speculatively (the first shape of --steps) and
plainly, and prints each split by named scope (benchmarks/profile_summary.py); with
--tau-only the rest is cheap:

    python benchmarks/decode_speed.py ... --steps 3 --tau-only --profile /tmp/prof

CPU (small settings, a few minutes):

    python benchmarks/decode_speed.py --target SmolLM2-135M-Instruct.Q4_1.gguf \\
        --draft random --prompts mt-bench --limit 2 --steps 3 --max-new-tokens 32 \\
        --dtype float32 --target-dtype float32
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from rich.console import Console

from eagle3kit.core import draft as draft_lib
from eagle3kit.core import target
from eagle3kit.core.config import DraftConfig
from eagle3kit.core.draft import DraftWeights
from eagle3kit.core.sharding import init_weights
from eagle3kit.core.vocab import VocabMap
from eagle3kit.core.vocab_arrays import VocabArrays
from eagle3kit.data.fingerprint import tokenizer_fingerprint
from eagle3kit.data.prompts import load_prompts
from eagle3kit.data.tokenizer import load_tokenizer
from eagle3kit.decode.engine import KV_ATTENTION
from eagle3kit.decode.speculative import Speculation
from eagle3kit.io.draft_io import Draft
from eagle3kit.io.hf import load_target, resolve_target
from eagle3kit.jobs import common, eval_batched
from eagle3kit.jobs.common import DTYPES, load_draft_for_target
from eagle3kit.jobs.evaluate import (
    EvalConfig,
    decode_config,
    generate_samples,
    generation_mesh,
    stop_ids,
)


def random_draft(ckpt, vocab_size: int) -> Draft:
    """An untrained draft over the lowest `vocab_size` ids: tau ~ 1, the cost floor."""
    cfg = DraftConfig.for_target(ckpt.config, vocab_size)
    w = init_weights(DraftWeights.abstract(cfg), jax.random.key(0))
    return Draft(cfg, w, VocabMap.from_ids(np.arange(vocab_size), ckpt.config.vocab_size))


def parse_shape(text: str) -> tuple[int, int, int | None]:
    """`K` -> (K, 1, None), a chain; `S/k/N` -> (S, k, N), a tree."""
    parts = [int(x) for x in text.split("/")]
    if len(parts) == 1:
        return parts[0], 1, None
    if len(parts) != 3:
        raise SystemExit(f"error: --steps {text!r}: expected K or S/k/N")
    return parts[0], parts[1], parts[2]


def peak_memory_gb() -> float | None:
    stats = jax.devices()[0].memory_stats() or {}
    peak = stats.get("peak_bytes_in_use")
    return None if peak is None else peak / 1e9


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", required=True)
    p.add_argument("--draft", required=True, help="a draft directory or Hub id, or `random`")
    p.add_argument("--prompts", default="mt-bench")
    p.add_argument("--limit", type=int, default=None, help="first N conversations")
    p.add_argument("--steps", default="3,5,7,5/4/8",
                   help="shapes to compare: K (chain) or S/k/N (tree), comma-separated")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    p.add_argument("--target-dtype", default="bfloat16", choices=sorted(DTYPES))
    p.add_argument("--mesh", default=None, help="tensor=N to split the target")
    p.add_argument("--random-vocab", type=int, default=32000)
    p.add_argument("--json", action="store_true", help="also print one JSON line per K")
    p.add_argument("--tau-only", action="store_true",
                   help="acceptance alone: no timed passes, no plain decoding (a third of the "
                        "work; tau on a CPU, where speed means nothing)")
    p.add_argument("--kv-attention", default="auto", choices=("auto", *KV_ATTENTION),
                   help="how the engine's steps read the KV cache (EngineConfig.attention; "
                        "auto, as eval: the kernel on one GPU)")
    p.add_argument("--check-every", type=int, default=None,
                   help="device steps between a program's checks whether to end early "
                        "(EngineConfig.check_every; a divisor of 8; default as eval: 8 for "
                        "several rows, 1 for one)")
    p.add_argument("--concurrency", default=None,
                   help="batch sizes for batched decoding, e.g. 1,8,32,64 (default: none)")
    p.add_argument("--profile", default=None, help="a directory: trace a pass of the answered "
                   "prompts both ways at --profile-batch and print where the time goes")
    p.add_argument("--profile-batch", type=int, default=8)
    args = p.parse_args()
    if args.profile:
        import profile_summary

        profile_summary.dump_engine_hlo(args.profile)
    console = Console(stderr=True)

    t0 = time.perf_counter()
    tokenizer = load_tokenizer(args.target)
    ckpt = resolve_target(args.target)
    tcfg = ckpt.config
    key = tokenizer_fingerprint(tokenizer, args.target).key
    draft = (random_draft(ckpt, min(args.random_vocab, tcfg.vocab_size))
             if args.draft == "random" else
             load_draft_for_target(args.draft, args.target, ckpt, key))
    mesh = generation_mesh(args.mesh)
    target_w = target.unstack_in_place(load_target(ckpt, mesh, DTYPES[args.target_dtype]), tcfg)
    vocab = VocabArrays.from_map(common.fit_vocab_to_target(draft.vocab, tcfg.vocab_size,
                                                            args.draft))
    weights = jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), draft.weights)
    draft_w = draft_lib.cast(weights, DTYPES[args.dtype])
    prompts = load_prompts(args.prompts, args.limit)
    stops = stop_ids(tokenizer, ckpt)
    console.print(f"loaded in {time.perf_counter() - t0:.1f}s; {prompts.num_turns} turns of "
                  f"{prompts.name} on {jax.device_count()} x {jax.devices()[0].device_kind}")

    rows, setups, answered = [], [], []
    for shape in args.steps.split(","):
        k, topk, nodes = parse_shape(shape)
        cfg = EvalConfig(target=args.target, draft=args.draft, prompts=args.prompts, steps=k,
                         topk=topk, draft_tokens=nodes, max_new_tokens=args.max_new_tokens,
                         temperature=args.temperature, target_dtype=args.target_dtype)
        dec = decode_config(cfg)
        setup = eval_batched.Setup(tcfg, target_w, mesh, stops,
                                   Speculation(draft.config, draft_w, vocab, dec),
                                   kv_attention=args.kv_attention,
                                   check_every=args.check_every)
        summary, samples = generate_samples(setup, prompts, tokenizer, cfg, console,
                                            timed=not args.tau_only)
        setups.append(setup)
        answered = answered or [s.prompt_ids for s in samples]
        rows.append({"shape": shape, "steps": k, "topk": topk, "draft_tokens": dec.nodes,
                     **summary, "peak_memory_gb": peak_memory_gb()})

    kv = setups[0].attention()  # what the engines used (auto resolved)
    check = (f"{args.check_every} steps" if args.check_every else
             f"{setups[0].checks(2)} steps at batch > 1")
    print(f"\n{tcfg.name} + {args.draft} on {prompts.name} ({prompts.num_turns} turns), "
          f"{jax.devices()[0].device_kind}, target {args.target_dtype}, draft {args.dtype}, "
          f"T={args.temperature:g}, max {args.max_new_tokens} new tokens, KV cache read by "
          f"{kv}, checks every {check}, jax {jax.__version__}, "
          f"python {platform.python_version()}\n")
    print("| shape | tau pooled | tau per request | spec tok/s | plain tok/s | speedup "
          "| identical | compile s | peak GB |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        mem = "-" if r["peak_memory_gb"] is None else f"{r['peak_memory_gb']:.1f}"
        same = ("-" if r.get("identical_to_baseline") is None
                else f"{r['identical_to_baseline']}/{r['prompts']}")
        timed = "tokens_per_s_speculative" in r  # not with --tau-only
        spec, plain, speedup, compile_s = (
            (f"{r['tokens_per_s_speculative']:.1f}", f"{r['tokens_per_s_baseline']:.1f}",
             f"{r['speedup']:.2f}x", f"{r['compile_s']:.0f}") if timed else ("-",) * 4)
        print(f"| {r['shape']} | {r['tau_pooled']:.2f} | {r['tau_per_request_mean']:.2f} "
              f"| {spec} | {plain} | {speedup} | {same} | {compile_s} | {mem} |")
    if args.json:
        for r in rows:
            print(json.dumps(r))
    if args.concurrency:
        batched(setups, answered, args, console)
    if args.profile:
        profile(setups[0], answered, args)


def batched(setups, prompt_ids, args, console) -> None:
    """Every shape at every batch size of --concurrency: a table and the winners."""
    out = eval_batched.measure(setups[0], prompt_ids,
                               eval_batched.parse_concurrency(args.concurrency),
                               [s.draft.dec for s in setups], console)
    print(f"\nbatched, continuous refill, {len(prompt_ids)} prompts, "
          f"{jax.devices()[0].device_kind}\n")
    print("| batch | shape | tau pooled | tau per request | spec tok/s | plain tok/s | speedup "
          "| identical |")
    print("|---|---|---|---|---|---|---|---|")
    for r in out["sweep"]:
        same = "-" if r["identical_to_baseline"] is None else r["identical_to_baseline"]
        print(f"| {r['batch']} | {r['shape']} | {r['tau_pooled']:.2f} "
              f"| {r['tau_per_request_mean']:.2f} | {r['tokens_per_s_speculative']:.1f} "
              f"| {r['tokens_per_s_baseline']:.1f} | {r['speedup']:.2f}x | {same} |")
    print()
    for b, r in out["best"].items():
        chain = out["best_chain"].get(b)
        print(f"recommended at batch {b}: {r['shape']} ({r['speedup']:.2f}x)"
              + (f"; vLLM (chains): K={chain['steps']} ({chain['speedup']:.2f}x)"
                 if chain else ""))
    if args.json:
        print(json.dumps(out))


def profile(setup, prompt_ids, args) -> None:
    """The first shape and plain decoding at --profile-batch rows: a pass that compiles, then
    the same pass traced (benchmarks/profile_summary.py)."""
    import profile_summary

    todo = eval_batched.requests(prompt_ids, args.max_new_tokens)
    slots = eval_batched.slots_for(prompt_ids, args.max_new_tokens, [setup.draft.dec])
    b = args.profile_batch
    for name, dec in ((eval_batched.shape_name(setup.draft.dec), setup.draft.dec),
                      ("plain", None)):
        engine = setup.engine(b, slots, dec)
        engine.generate(todo)
        summary = profile_summary.profile_engine(
            engine, todo, Path(args.profile) / f"trace-{name.replace('/', '-')}-b{b}",
            Path(args.profile) / "hlo")
        print(f"\nprofile, batch {b}, {name}: {len(todo)} prompts, traced\n```\n{summary}"
              f"\n```", flush=True)


if __name__ == "__main__":
    main()
