"""The host's share of `regenerate`: what Python does per engine step of the conversation loop
(scheduling turns and samples, refills, repetition checks, detokenizing, rendering the next
prompt, writing records) and how often it waits on the device, measured where the device's
own time can be told apart: on any machine, with a target small enough that its programs
take little time.

`regenerate` runs in this process as the CLI runs it. Counted per engine step (one
`Engine.step`: admissions, copies, prefill pieces, one step program): the main thread's CPU
seconds (`time.thread_time`: XLA runs its programs in threads of its own, so this is the
host's work plus dispatch), the device reads (`jax.device_get`, each a sync that stalls the
pipeline) and the seconds spent blocked in them, and the programs dispatched by name.
`--profile FILE` writes cProfile's statistics of the whole run too.

    python benchmarks/regen_host.py --target TINY_DIR --input chats.jsonl --slots 256 \\
        --samples 2 --temperature 0.7 --top-p 0.95 --on-repetition drop-answer \\
        --max-new-tokens 64 --max-context 1024 [--profile /tmp/regen.prof]
    # the engine's plain generate on the same rows' first turns, for comparison
    python benchmarks/regen_host.py ... --first-turns-plain
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import json
import sys
import time

import jax


class Meter:
    """Wraps the functions whose calls are counted; `report()` gives the totals."""

    def __init__(self):
        self.calls: collections.Counter = collections.Counter()
        self.seconds: collections.Counter = collections.Counter()
        self.cpu: collections.Counter = collections.Counter()

    def wrap(self, owner, name: str, label: str) -> None:
        fn = getattr(owner, name)

        def counted(*args, **kwargs):
            t0, c0 = time.perf_counter(), time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                self.calls[label] += 1
                self.seconds[label] += time.perf_counter() - t0
                self.cpu[label] += time.thread_time() - c0

        setattr(owner, name, counted)


def instrument(meter: Meter) -> None:
    from eagle3kit.decode import engine, executables

    meter.wrap(jax, "device_get", "device_get")
    meter.wrap(engine.Engine, "step", "engine.step")
    call = executables.Program.__call__

    def dispatched(self, *args, **kwargs):
        meter.calls["program " + self.name] += 1
        return call(self, *args, **kwargs)

    executables.Program.__call__ = dispatched


def stop_more(extra: int) -> None:
    """`extra` more stop ids beside the target's own, spread over its vocabulary: a random
    target's tokens are about uniform, so its answers end at varied lengths (about
    vocab / extra tokens on average) as real ones do, and rows finish and refill at
    different steps."""
    from eagle3kit.jobs import evaluate

    own = evaluate.stop_ids

    def stops(tokenizer, ckpt, renderer):
        vocab = ckpt.config.vocab_size
        return [*own(tokenizer, ckpt, renderer), *range(vocab // extra // 2, vocab,
                                                        vocab // extra)]

    evaluate.stop_ids = stops


def regenerate_run(args) -> None:
    from rich.console import Console

    from eagle3kit.jobs import regenerate
    from eagle3kit.jobs.regen_work import RegenerateConfig

    cfg = RegenerateConfig(
        target=args.target, input=args.input, out=args.out, temperature=args.temperature,
        top_p=args.top_p, seed=0, samples=args.samples, max_new_tokens=args.max_new_tokens,
        max_context=args.max_context, turns=args.turns, on_repetition=args.on_repetition,
        limit=args.limit, force=True, slots=args.slots, target_dtype="float32",
        kv_attention="xla", mesh="data=1,tensor=1")
    regenerate.run(cfg, Console(stderr=True))


def first_turns_plain(args) -> None:
    """The engine's generate on the first turns of the same conversations (as many requests
    as the regeneration's first turns), rows and limits as there."""
    import jax.numpy as jnp
    import numpy as np

    from eagle3kit.core.sharding import make_mesh
    from eagle3kit.core.target import unstack_in_place
    from eagle3kit.data.records import read_chat_records
    from eagle3kit.data.tokenizing import make_renderer
    from eagle3kit.decode.conversations import Dialogue
    from eagle3kit.decode.engine import Engine, EngineConfig, Request, Sampling
    from eagle3kit.io.hf import load_target, resolve_target
    from eagle3kit.jobs import common

    tok, _ = common.target_tokenizer(args.target, required=True)
    renderer = make_renderer(tok, None, None, args.target)
    prompts = []
    for r in read_chat_records(args.input):
        msgs = Dialogue(r.messages, True).prompt()
        if msgs:
            ids = renderer.prompt_ids(msgs)
            if len(ids) + args.max_new_tokens <= args.max_context:
                prompts += [ids] * args.samples
        if args.limit and len(prompts) >= args.limit * args.samples:
            break
    ckpt = resolve_target(args.target)
    mesh = make_mesh("data=1,tensor=1", jax.devices()[:1])
    w = unstack_in_place(load_target(ckpt, mesh, jnp.float32), ckpt.config)
    from eagle3kit.jobs import evaluate

    stops = evaluate.stop_ids(tok, ckpt, renderer)
    engine = Engine(ckpt.config, w, mesh, stops, EngineConfig(
        rows=min(args.slots, 1 << (len(prompts) - 1).bit_length()),
        max_context=args.max_context, sampling=Sampling(args.temperature, args.top_p)))
    requests = [Request(i, p, args.max_new_tokens, i) for i, p in enumerate(prompts)]
    done = engine.generate(requests)
    print(f"plain generate: {len(done)} answers, {sum(len(c.tokens) for c in done)} tokens, "
          f"{np.mean([len(p) for p in prompts]):.0f} prompt tokens on average",
          file=sys.stderr)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", required=True, help="HF directory (a tiny random target)")
    ap.add_argument("--input", required=True, help="conversations (mix schema JSONL)")
    ap.add_argument("--out", default=None, help="the records (default: a temporary file)")
    ap.add_argument("--limit", type=int, default=None)
    ap.add_argument("--slots", type=int, default=256)
    ap.add_argument("--samples", type=int, default=2)
    ap.add_argument("--turns", default="all")
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--top-p", type=float, default=0.95)
    ap.add_argument("--on-repetition", default="keep", help="the recipe drops looping answers "
                    "and their conversation's later turns; a random target loops often")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--max-context", type=int, default=1024)
    ap.add_argument("--first-turns-plain", action="store_true")
    ap.add_argument("--extra-stops", type=int, default=16, help="stop ids added (stop_more)")
    ap.add_argument("--profile", default=None, help="cProfile statistics to this file")
    args = ap.parse_args()

    if args.out is None:
        import tempfile

        args.out = tempfile.mkdtemp(prefix="regen-host-") + "/out.jsonl"
    run = first_turns_plain if args.first_turns_plain else regenerate_run
    if args.extra_stops:
        stop_more(args.extra_stops)
    run(args)  # a warm-up run: every program compiled (and a second run compiles none)
    meter = Meter()
    instrument(meter)
    profile = cProfile.Profile() if args.profile else None
    t0, c0 = time.perf_counter(), time.thread_time()
    if profile:
        profile.enable()
    run(args)
    if profile:
        profile.disable()
        profile.dump_stats(args.profile)
    wall, cpu = time.perf_counter() - t0, time.thread_time() - c0
    steps = max(meter.calls["engine.step"], 1)
    out = {
        "wall_s": round(wall, 2), "main_thread_cpu_s": round(cpu, 2),
        "engine_steps": meter.calls["engine.step"],
        "step_wall_ms": round(1e3 * meter.seconds["engine.step"] / steps, 2),
        "device_gets_per_step": round(meter.calls["device_get"] / steps, 2),
        "blocked_in_device_get_ms_per_step": round(1e3 * meter.seconds["device_get"] / steps, 2),
        # the host's own work per step: the main thread's CPU time outside the waits
        "host_cpu_ms_per_step": round(1e3 * (cpu - meter.cpu["device_get"]) / steps, 2),
        "programs_per_step": {k.removeprefix("program "): round(v / steps, 2)
                              for k, v in sorted(meter.calls.items())
                              if k.startswith("program ")},
    }
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
