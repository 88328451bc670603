"""What `eagle3kit eval --prompts` compiles: every program, how often and how long (issue 36).

Runs `eagle3kit eval` with the arguments after `--` in this process and listens to JAX's
compile events: for each program (jit name and the shapes it met) the seconds of tracing,
lowering to MLIR and XLA's compile (or the load from the persistent compile cache), or the
load of a whole executable kept by decode/executables.py (nothing traced), then a
table to stderr and one JSON line to stdout: {"programs": [...], "totals": {...}, "eval":
eval's own --json object when asked for}. Run it twice with the same EAGLE3KIT_COMPILE_CACHE
(a CPU uses the cache only where that variable is set) to see what the cache serves.

GPU (the lead's MT-bench shapes; the second run reads the first one's cache):

    for i in 1 2; do EAGLE3KIT_COMPILE_CACHE=/tmp/xla python benchmarks/eval_compiles.py -- \\
        --target SmolLM2-135M-Instruct.Q4_1.gguf --draft DRAFT --prompts mt-bench --steps 7 \\
        --max-new-tokens 256 --target-dtype bfloat16 --dtype bfloat16 --json; done

CPU (small settings): the same with `--limit 2 --max-new-tokens 32 --dtype float32
--target-dtype float32`; `--kv-attention pallas` before `--` makes the engines read the
cache through the ragged kernel (Pallas' interpreter off a GPU: slow, for counting only).
"""

from __future__ import annotations

import argparse
import collections
import io
import json
import re
import sys
import time
from contextlib import redirect_stdout

import jax

PHASES = {"/jax/core/compile/jaxpr_trace_duration": "trace",
          "/jax/core/compile/jaxpr_to_mlir_module_duration": "lower",
          "/jax/core/compile/backend_compile_duration": "compile",
          # a program loaded whole from the kept executables (decode/executables.py)
          "/eagle3kit/executables/load_duration": "load"}


def main() -> None:
    argv = sys.argv[1:]
    ours, eval_args = (argv[: argv.index("--")], argv[argv.index("--") + 1:]) \
        if "--" in argv else ([], argv)
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--kv-attention", default="auto", help="auto, xla or pallas (the engines')")
    args = p.parse_args(ours)
    seconds: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    order: list[str] = []

    def listen(event: str, duration: float, fun_name: str = "?", **_) -> None:
        phase = PHASES.get(event)
        if phase is None:
            return
        fun_name = re.sub(r"^jit_?\(?(.*?)\)?$", r"\1", fun_name)  # trace: f, else jit(f)
        if fun_name not in seconds:
            order.append(fun_name)
        seconds[fun_name][phase] += duration
        seconds[fun_name][phase + "s"] += 1

    jax.monitoring.register_event_duration_secs_listener(listen)
    from eagle3kit.cli.app import app as cli
    from eagle3kit.jobs import eval_batched

    eval_batched.Setup.kv_attention = args.kv_attention  # the dataclass field's default
    out = io.StringIO()
    t0 = time.perf_counter()
    with redirect_stdout(out):
        try:
            cli(["eval", *eval_args], standalone_mode=False)
        except SystemExit as e:
            if e.code:
                raise
    wall = time.perf_counter() - t0
    rows = [{"program": name, **{k: round(v, 3) if isinstance(v, float) else v
                                 for k, v in seconds[name].items()}} for name in order]
    totals = {phase: round(sum(r.get(phase, 0) for r in rows), 2) for phase in
              ("trace", "lower", "compile", "load")}
    totals.update(programs=sum(r.get("compiles", 0) for r in rows),
                  loaded=sum(r.get("loads", 0) for r in rows), wall_s=round(wall, 1))
    big = sorted(rows, key=lambda r: -(r.get("trace", 0) + r.get("lower", 0)
                                       + r.get("compile", 0) + r.get("load", 0)))
    print(f"{'program':<40} {'n':>3} {'trace s':>8} {'lower s':>8} {'compile s':>9} "
          f"{'loaded':>6} {'load s':>7}", file=sys.stderr)
    for r in big:
        print(f"{r['program'][:40]:<40} {r.get('compiles', 0):>3} {r.get('trace', 0):>8.2f} "
              f"{r.get('lower', 0):>8.2f} {r.get('compile', 0):>9.2f} {r.get('loads', 0):>6} "
              f"{r.get('load', 0):>7.2f}", file=sys.stderr)
    print(f"{'total':<40} {totals['programs']:>3} {totals['trace']:>8.2f} "
          f"{totals['lower']:>8.2f} {totals['compile']:>9.2f} {totals['loaded']:>6} "
          f"{totals['load']:>7.2f}   (wall {wall:.1f} s)", file=sys.stderr)
    lines = [x for x in out.getvalue().splitlines() if x.startswith("{")]
    print(json.dumps({"programs": rows, "totals": totals,
                      "eval": json.loads(lines[-1]) if lines else None}))


if __name__ == "__main__":
    main()
