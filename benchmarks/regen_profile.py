"""Where a real `regenerate` run's steady state spends its time (issue 36 item 4).

    python benchmarks/regen_profile.py --at 120 --seconds 8 --out /tmp/rp -- \\
        --target model.gguf -i chats.jsonl -o regen.jsonl --turns all --samples 2 ...

Runs `eagle3kit regenerate` with the arguments after `--` in this process and, from `--at`
seconds after its engine is built (loading and compiling done, the rows full), traces
`--seconds` of it: the wall time per device step split into device time by program (step,
prefill), device idle time inside programs and host time between them (the engine's
scheduling of turns, samples and refills), then the step's device time by named scope
(`profile_summary.engine_summary`, as `generate_speed.py --profile` reports first turns).
The summary goes to OUT/summary.md and stdout; the run goes on to its end (or its timeout).
Without CUDA graphs, as every profile here (each kernel named): compare its rate with the
untraced run's progress line, not with another profile.
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import profile_summary  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--at", type=float, default=120.0,
                    help="seconds after the engine is built when the trace starts")
    ap.add_argument("--seconds", type=float, default=8.0, help="length of the trace")
    ap.add_argument("--out", required=True, help="directory for the trace, HLO and summary")
    ap.add_argument("regenerate_args", nargs=argparse.REMAINDER,
                    help="-- then the arguments of `eagle3kit regenerate`")
    args = ap.parse_args()
    rest = args.regenerate_args[1:] if args.regenerate_args[:1] == ["--"] else args.regenerate_args
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    profile_summary.dump_engine_hlo(str(out))  # before JAX starts its backend

    import jax

    from eagle3kit.decode import engine as engine_mod

    built: list = []
    init = engine_mod.Engine.__init__

    def record(self, *a, **k):
        init(self, *a, **k)
        built.append((self, time.perf_counter()))

    engine_mod.Engine.__init__ = record

    def trace() -> None:
        while not built:
            time.sleep(0.5)
        engine, t_built = built[0]
        time.sleep(max(0.0, t_built + args.at - time.perf_counter()))
        programs: list[tuple[str, float, int]] = []
        restore = profile_summary.time_programs(engine, programs)
        tokens = engine.generated_tokens
        jax.profiler.start_trace(str(out / "trace"))
        t0 = time.perf_counter()
        time.sleep(args.seconds)
        # the window's end, read before stop_trace: writing the trace takes seconds, in
        # which the run goes on (its tokens and programs are not the window's)
        wall = time.perf_counter() - t0
        tokens = engine.generated_tokens - tokens
        window = list(programs)  # what ran inside the window
        restore()
        jax.profiler.stop_trace()
        text = (f"regenerate, traced {wall:.1f} s from {args.at:.0f} s after the engine was "
                f"built: {tokens:,} tokens, {tokens / wall:,.0f} tokens/s while traced\n\n"
                + profile_summary.engine_summary(profile_summary.kernels(out / "trace")[0],
                                                 profile_summary.op_names(out / "hlo"),
                                                 window, wall, tokens, 0.0))
        (out / "summary.md").write_text(text + "\n")
        print(text, flush=True)

    threading.Thread(target=trace, daemon=True).start()
    from eagle3kit.cli.app import main as cli

    sys.argv = ["eagle3kit", "regenerate", *rest]
    cli()


if __name__ == "__main__":
    main()
