"""Where a jitted step's device time goes: a profiler trace summed by `jax.named_scope`.

    summary = summarize(trace_dir, hlo_dir, steps)   # after jax.profiler.start/stop_trace
    summary = profile_engine(engine, requests, trace_dir, hlo_dir)   # the decoding engine

`profile_engine` traces one `Engine.generate` (its programs compiled before) and splits the
wall time per device step into device time (by program, and the step's by named scope:
draft, the target's q/k/v, cache write, attention, o_proj, MLP, lm head, sampling or
acceptance) and the time the device waited: inside a program (kernel launches, the while
loop's per-step sync) and between programs (the engine's host loop).

Device kernels carry the name of the HLO instruction they run (`hlo_op`); the optimized HLO
that XLA dumps (`--xla_dump_to`, `--xla_dump_hlo_as_text`) maps each instruction to the
`op_name` of its source, whose path holds the named scopes (`target/attention`,
`ttt_step3/ttt_attention`, `optimizer`, ...) and `transpose(...)` for the backward pass.
"""

from __future__ import annotations

import collections
import os
import re
import time
from collections.abc import Callable
from pathlib import Path

# (scope part of an op_name, row label), first match wins
PARTS = [("target_head", "target lm_head + softmax"), ("target", "target forward"),
         ("ttt_attention", "TTT attention"), ("draft_qkv", "draft norms + q/k/v"),
         ("draft_mlp", "draft o_proj + MLP"), ("draft_head", "draft lm_head"),
         ("loss", "soft CE + accuracy"), ("fc", "draft fc"), ("optimizer", "optimizer")]
_INSTR = re.compile(r'^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=(?:.*?op_name="([^"]*)")?', re.M)
_CALLS = re.compile(r'^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=.*?calls=%?([\w.\-]+)', re.M)
_COMPUTATION = re.compile(r'^(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$', re.M)


def dump_engine_hlo(profile_dir: str) -> None:
    """Before JAX starts its backend (it reads XLA_FLAGS then): XLA dumps the engine's
    optimized programs to PROFILE_DIR/hlo, which `profile_engine` reads to name every
    kernel, and builds no CUDA graphs (a command buffer shows as one opaque kernel)."""
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + f" --xla_dump_to="
                               f"{profile_dir}/hlo --xla_dump_hlo_as_text "
                               "--xla_dump_hlo_module_re=.*(_decode|_verify|_prefill|mixed_program).* "
                               "--xla_gpu_enable_command_buffer=").strip()


def op_names(hlo_dir: Path) -> dict[tuple[str, str], str]:
    """(program, instruction) and ("", instruction) -> op_name, from XLA's optimized dumps
    (module_NNNN.<name>...: NNNN is the program id a trace's kernels carry; programs of one
    jitted function share its name but not their instructions' names)."""
    out: dict[tuple[str, str], str] = {}
    for f in Path(hlo_dir).glob("*after_optimizations.txt"):
        text = f.read_text()
        program = re.match(r"module_0*(\d+)\.", f.name)
        ops = dict(_INSTR.findall(text))  # op "": an instruction without one
        # a fusion without one is named by the first op inside the computation it calls
        inside: dict[str, str] = {}
        heads = list(_COMPUTATION.finditer(text))
        for head, nxt in zip(heads, heads[1:] + [None], strict=True):
            body = text[head.end(): nxt.start() if nxt else len(text)]
            found = re.search(r'op_name="([^"]*)"', body)
            inside[head.group(1)] = found.group(1) if found else ""
        for name, called in _CALLS.findall(text):
            if not ops.get(name):
                ops[name] = inside.get(called, "")
        for name, op in ops.items():
            out[(program.group(1) if program else "", name)] = op
            if op:
                out.setdefault(("", name), op)
    return out


def label(op_name: str) -> str:
    part = next((lab for key, lab in PARTS if re.search(rf"(^|[/(]){key}([/)]|$)", op_name)),
                "other")
    backward = "transpose(" in op_name
    return f"{part} ({'backward' if backward else 'forward'})" if part not in (
        "optimizer", "other", "target forward", "target lm_head + softmax") else part


def kernels(trace_dir: Path) -> tuple[list[tuple[str, str, str, float, float]], set[str]]:
    """([(module, program id, hlo_op, start ns, duration ns)] of every device kernel (on a
    CPU: every XLA op the host ran), the trace's line names)."""
    from jax.profiler import ProfileData
    out, lines_seen = [], set()
    for path in Path(trace_dir).rglob("*.xplane.pb"):
        for plane in ProfileData.from_file(str(path)).planes:
            gpu = plane.name.startswith("/device:GPU")
            if not (gpu or plane.name == "/host:CPU"):
                continue
            for line in plane.lines:
                lines_seen.add(line.name)
                if gpu and not line.name.startswith("Stream"):
                    continue  # the kernels, not the derived per-module or per-op lines
                for e in line.events:
                    stats = dict(e.stats)
                    if stats.get("hlo_op"):
                        out.append((stats.get("hlo_module", ""),
                                    str(stats.get("program_id", "")), stats["hlo_op"],
                                    e.start_ns, e.duration_ns))
    return out, lines_seen


def summarize(trace_dir: Path, hlo_dir: Path, steps: int, top: int = 12) -> str:
    names = op_names(hlo_dir)
    by_label: dict[str, float] = collections.Counter()
    by_op: dict[tuple[str, str], float] = collections.Counter()
    by_step: dict[str, float] = collections.Counter()
    found, lines_seen = kernels(trace_dir)
    for _, program, op, _, duration in found:
        op_name = names.get((program, op), names.get(("", op), ""))
        by_label[label(op_name)] += duration
        by_op[(op, op_name)] += duration
        m = re.search(r"ttt_step(\d+)", op_name)
        by_step[f"TTT step {m.group(1)}" if m else "outside the TTT steps"] += duration
    total = sum(by_label.values())
    if not total:
        return f"no device kernels with hlo_op found (lines: {sorted(lines_seen)})"
    ms = 1e6 * steps
    rows = [f"device time per step: {total / ms:.1f} ms (kernels only, {steps} steps traced)"]
    rows += [f"  {lab:<34} {t / ms:8.1f} ms {100 * t / total:5.1f}%"
             for lab, t in sorted(by_label.items(), key=lambda x: -x[1])]
    rows.append("per TTT step (forward + backward):")
    rows += [f"  {k:<34} {t / ms:8.1f} ms" for k, t in sorted(by_step.items())]
    rows.append(f"top {top} kernels:")
    rows += [f"  {t / ms:7.2f} ms  {op[:40]:<40} {op_name[-90:]}"
             for (op, op_name), t in by_op.most_common(top)]
    return "\n".join(rows)


# ---- the decoding engine (decode/engine.py) ---------------------------------------------

# (named scope in an op_name, row label) for a decode or verify step, first match wins: the
# scopes of decode/engine.py, decode/speculative.py and core/target.py
STEP_PARTS = [("draft_extend", "draft: step-0 entries (extend)"), ("draft", "draft: drafting"),
              ("cache_write", "target: KV cache write"), ("attend", "target: attention"),
              ("qkv", "target: norm + q/k/v + rope"), ("o_proj", "target: o_proj"),
              ("mlp", "target: norm + MLP"), ("embed", "target: embedding"),
              ("final_norm", "target: final norm"), ("lm_head", "lm head (fp32 logits)"),
              ("sampling", "sampling"), ("accept", "acceptance"),
              ("commit", "tree: accepted keys moved"), ("bookkeeping", "row state")]


def step_part(op_name: str) -> str:
    return next((lab for key, lab in STEP_PARTS
                 if re.search(rf"(^|[/(]){key}([/)]|$)", op_name)), "other")


def busy_ns(spans: list[tuple[float, float]]) -> float:
    """Length of the union of (start, duration) spans: time the device was busy."""
    total, end = 0.0, float("-inf")
    for start, duration in sorted(spans):
        total += max(0.0, start + duration - max(start, end))
        end = max(end, start + duration)
    return total


def program_kind(module: str) -> str:
    """"step" (a decode, verify or mixed program: decode/mixed.py), "prefill" or "other",
    from its HLO module."""
    return ("step" if re.search(r"_decode|_verify|mixed_program", module) else
            "prefill" if "_prefill" in module else "other")


def time_programs(engine, programs: list) -> Callable[[], None]:
    """Wraps the engine's step, prefill and mixed programs: each call appends (kind, wall
    seconds, device steps) to `programs`, waiting for its result as the engine does. Returns
    what puts the engine's own programs back."""
    import jax

    def timed(kind, fn):
        def call(*args, **kwargs):
            t0 = time.perf_counter()
            out = jax.block_until_ready(fn(*args, **kwargs))
            programs.append((kind, time.perf_counter() - t0, int(out[-1]) if kind == "step"
                             else 0))
            return out
        return call

    step, prefill, mixed = engine._step, engine._prefill, engine._mixed
    engine._step, engine._prefill = timed("step", step), timed("prefill", prefill)
    if mixed:  # prompts riding in steps (--mixed-budget)
        engine._mixed = timed("step", mixed)

    def restore() -> None:
        engine._step, engine._prefill, engine._mixed = step, prefill, mixed
    return restore


def profile_engine(engine, requests, trace_dir: Path, hlo_dir: Path, top: int = 10) -> str:
    """Traces `engine.generate(requests)` (run it once before, so nothing compiles) and
    returns where its wall time went (module docstring). The optimized HLO of its programs
    must be dumped to `hlo_dir` (XLA_FLAGS --xla_dump_to, set before JAX starts)."""
    import jax

    programs: list[tuple[str, float, int]] = []  # (kind, wall seconds, device steps)
    compiling: list[float] = []

    def on_event(event: str, duration: float, **_) -> None:
        if event.startswith("/jax/core/compile/"):
            compiling.append(duration)

    restore = time_programs(engine, programs)
    jax.monitoring.register_event_duration_secs_listener(on_event)
    tokens = engine.generated_tokens
    jax.profiler.start_trace(str(trace_dir))
    t0 = time.perf_counter()
    try:
        engine.generate(requests)
    finally:
        wall = time.perf_counter() - t0
        jax.profiler.stop_trace()
        jax.monitoring.unregister_event_duration_listener(on_event)
        restore()
    tokens = engine.generated_tokens - tokens
    return engine_summary(kernels(trace_dir)[0], op_names(hlo_dir), programs, wall, tokens,
                          sum(compiling), top)


def engine_summary(found, names, programs, wall: float, tokens: int, compile_s: float,
                   top: int = 10) -> str:
    """The text of `profile_engine` from the kernels `found`, the HLO op names and the
    programs' (kind, wall seconds, device steps)."""
    steps = sum(p[2] for p in programs)
    per = steps or 1  # per device step (per program where no step ran)
    unit = "device step" if steps else "program"
    by_kind: dict[str, list] = collections.defaultdict(list)
    by_part: dict[str, float] = collections.Counter()
    by_op: dict[tuple[str, str], float] = collections.Counter()
    for module, program, op, start, duration in found:
        kind = program_kind(module)
        by_kind[kind].append((start, duration))
        # a CPU traces a while loop (or conditional) around its body's ops: not a kernel
        if kind == "step" and not re.match(r"(while|conditional|call)(\.|$)", op):
            op_name = names.get((program, op), names.get(("", op), ""))
            by_part[step_part(op_name)] += duration
            by_op[(op, op_name)] += duration
    busy = {k: busy_ns(v) / 1e9 for k, v in by_kind.items()}
    in_programs = sum(p[1] for p in programs)
    count = collections.Counter(p[0] for p in programs)
    ms = 1e3 / per
    rows = [f"traced: {len(programs)} programs ({count['step']} decode/verify, "
            f"{count['prefill']} prefill), {steps} device steps, {tokens} tokens "
            f"({tokens / per:.1f} a step), {wall:.2f} s wall"
            + (f"; JAX compiled for {compile_s:.1f} s meanwhile (warm up first)"
               if compile_s else ""),
            f"wall per {unit}: {wall * ms:.2f} ms ="]
    split = [(f"device busy, {k} programs", busy[k]) for k in ("step", "prefill", "other")
             if k in busy]
    split += [("device idle inside programs (launches, syncs)",
               in_programs - sum(busy.values())),
              ("host between programs (the engine's loop)", wall - in_programs)]
    rows += [f"  {lab:<48} {t * ms:8.2f} ms {100 * t / wall:5.1f}%" for lab, t in split]
    total = sum(by_part.values())
    if not total:
        return "\n".join(rows + ["no kernels of a decode or verify program in the trace"])
    rows.append(f"decode/verify programs' device time per {unit}, by part:")
    rows += [f"  {lab:<48} {t / 1e6 / per:8.2f} ms {100 * t / total:5.1f}%"
             for lab, t in sorted(by_part.items(), key=lambda x: -x[1])]
    rows.append(f"top {top} kernels of those programs (ms per {unit}):")
    rows += [f"  {t / 1e6 / per:7.3f} ms  {op[:36]:<36} {op_name[-80:]}"
             for (op, op_name), t in by_op.most_common(top)]
    return "\n".join(rows)
