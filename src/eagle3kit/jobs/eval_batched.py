"""`eval --prompts` speeds, at batch 1 and at the `--concurrency` batch sizes, and `--sweep`.

For each batch size B the answered prompts (every turn's prompt, with the earlier turns'
answers in it) are decoded twice by the one engine (decode/engine.py) with continuous refill
of B rows: speculatively (with the draft) and plainly (the target alone), same prompts, same
max_new_tokens, same request streams, so the speedup at B is measured, not assumed. A timed
run during which JAX compiled anything is run again and timed again (`timed_call`; the same
requests take the same shapes): end to end at B > 1, and at batch 1 one answer at a time
(jobs/evaluate.generate_samples: only the answers that compiled are run twice).

`--sweep` repeats the speculative half over a grid of drafting shapes (the plain baseline of
each B is measured once) and the run's own shape, and names the fastest shape per B by
measured speedup.
"""

from __future__ import annotations

import dataclasses
import os
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import jax

from eagle3kit.decode import executables
from eagle3kit.decode.acceptance import acceptance_summary
from eagle3kit.decode.engine import (
    Engine,
    EngineConfig,
    Request,
    Sampling,
    check_memory,
    memory_estimate,
)
from eagle3kit.decode.kv_attention import KVAttention, resolve_kv_attention
from eagle3kit.decode.speculative import DecodeConfig, Speculation
from eagle3kit.errors import UserError

# chains K = 3, 5, 7 and SGLang-style trees S/k/N
DEFAULT_SWEEP = "3;5;7;3/4/8;5/4/8;5/8/16"
SPEC_SYNC = 8  # verify steps per device program (each emits 1..K+1 tokens), batch > 1
PLAIN_SYNC = 32  # plain decode steps per device program
# steps between a batched program's checks whether to end early (EngineConfig.check_every):
# each check reads the loop's condition back to the host while the device waits, which costs
# a batch more than the few steps a finished row idles until its refill (docs/benchmarks.md,
# issue 22, "checks every E steps"). One row checks every step: its program ends when it
# finishes, and idle steps would delay only that row.
BATCHED_CHECK_EVERY = 8
ONE_ROW_PIECE = 256  # prompt tokens a batch-1 prefill program takes (every piece padded)


def parse_concurrency(text: str | None) -> tuple[int, ...]:
    """`1,8,32` -> (1, 8, 32): batch sizes, each >= 1, no repeats."""
    if not text:
        return ()
    try:
        sizes = tuple(int(x) for x in text.split(","))
    except ValueError:
        raise UserError(f"--concurrency {text!r}: expected batch sizes like 1,8,32,64") from None
    if any(b < 1 for b in sizes) or len(set(sizes)) != len(sizes):
        raise UserError(f"--concurrency {text!r}: batch sizes must be >= 1 and distinct")
    return sizes


def parse_shape(text: str) -> tuple[int, int, int | None]:
    """`K` -> (K, 1, None), a chain; `S/k/N` -> (S, k, N), a tree."""
    try:
        parts = [int(x) for x in text.split("/")]
    except ValueError:
        parts = []
    if len(parts) == 1:
        return parts[0], 1, None
    if len(parts) != 3:
        raise UserError(f"--sweep-grid: {text!r} is neither K (a chain) nor S/k/N (a tree)")
    return parts[0], parts[1], parts[2]


def parse_sweep(text: str | None, base: DecodeConfig) -> list[DecodeConfig]:
    """`3;5;5/4/8` -> the decode configs of the grid (checked as SGLang would)."""
    configs = []
    for item in (text or DEFAULT_SWEEP).split(";"):
        steps, topk, nodes = parse_shape(item.strip())
        dec = dataclasses.replace(base, steps=steps, topk=topk, draft_tokens=nodes)
        try:
            dec.check()
        except ValueError as e:
            raise UserError(f"--sweep-grid {item!r}: {e}") from None
        configs.append(dec)
    return configs


def shape_name(dec: DecodeConfig) -> str:
    return f"{dec.steps}" if not dec.is_tree else f"{dec.steps}/{dec.topk}/{dec.nodes}"


def best_per_batch(entries: Sequence[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """{str(batch): the entry of highest measured speedup at that batch} (ties: the first)."""
    best: dict[str, dict[str, Any]] = {}
    for e in entries:
        key = str(e["batch"])
        if key not in best or e["speedup"] > best[key]["speedup"]:
            best[key] = e
    return best


@dataclasses.dataclass
class Setup:
    """One target (per-layer weights, held once), its draft and the run's settings."""

    tcfg: Any
    target_w: Any  # target.LayerList
    mesh: Any
    stops: list[int]
    draft: Speculation  # the draft and the drafting shape of the run
    seed: int = 0
    kv_attention: str = "auto"  # EngineConfig.attention, or auto: the kernel on one GPU
    check_every: int | None = None  # EngineConfig.check_every (a divisor of SPEC_SYNC and
    # PLAIN_SYNC); None: BATCHED_CHECK_EVERY for several rows, 1 for one
    slots: int = 0  # the run's cache size so far (every engine's, so that each program
    # compiles once a run, not once per cache size): grown by generate_samples and measure

    def engine(self, rows: int, slots: int, dec: DecodeConfig | None) -> Engine:
        """Speculative with drafting shape `dec`, or plain with None."""
        return Engine(self.tcfg, self.target_w, self.mesh, self.stops,
                      *self._config(rows, slots, dec))

    def check_fits(self, rows: int, slots: int, dec: DecodeConfig | None) -> None:
        """Engine's own memory check for `engine(rows, slots, dec)`, without building it
        (OutOfMemory where it cannot fit)."""
        cfg, spec = self._config(rows, slots, dec)
        check_memory(memory_estimate(self.tcfg, cfg, self.target_w.embed.dtype, spec),
                     self.mesh)

    def _config(self, rows: int, slots: int, dec: DecodeConfig | None
                ) -> tuple[EngineConfig, Speculation | None]:
        temperature = self.draft.dec.temperature
        # one row waits for nobody: its programs run until it finishes (fewer host syncs)
        sync = PLAIN_SYNC if dec is None or rows == 1 else SPEC_SYNC
        # one row's prompts in pieces of one shape: two prefill programs (first pieces and
        # later ones), not one per 128-token bucket and up, each compiled for both engines
        one = {"prefill_chunk": ONE_ROW_PIECE, "one_prefill_shape": True} if rows == 1 else {}
        return (EngineConfig(rows=rows, max_context=slots, sync_every=sync,
                             sampling=Sampling(temperature), seed=self.seed,
                             attention=self.attention(), check_every=self.checks(rows), **one),
                dataclasses.replace(self.draft, dec=dec) if dec else None)

    def attention(self) -> KVAttention:
        """How the engines read the KV caches (`auto` resolved for the mesh's devices)."""
        return resolve_kv_attention(self.kv_attention, self.mesh.devices.flatten())

    def checks(self, rows: int) -> int:
        """Steps between a program's checks whether to end early, at `rows` rows."""
        return self.check_every or (BATCHED_CHECK_EVERY if rows > 1 else 1)


def slots_for(prompts: Sequence[Sequence[int]], max_new: int, decs: Sequence[DecodeConfig]
              ) -> int:
    """Slots a row needs for the longest prompt, its answer and one verify: a power of two
    from 256 (few cache shapes, so the engines of a run share their programs)."""
    return slots_for_length(max(len(p) for p in prompts), max_new, decs)


def slots_for_length(prompt_len: int, max_new: int, decs: Sequence[DecodeConfig]) -> int:
    """slots_for of a prompt of `prompt_len` tokens."""
    need = prompt_len + max_new + max(d.verified for d in decs)
    return max(256, 1 << (need - 1).bit_length())


def check_sizes(setup: Setup, batches: Sequence[int], max_new: int) -> None:
    """Refuses (OutOfMemory) a batch size whose engines cannot fit even the smallest cache
    `measure` can give them, before the batch-1 answers are generated (on a large target
    those take minutes, and a size that cannot fit would be told only after them)."""
    slots = max(setup.slots, slots_for_length(1, max_new, [setup.draft.dec]))
    for b in batches:
        for dec in (None, setup.draft.dec):
            setup.check_fits(b, slots, dec)


def requests(prompts: Sequence[Sequence[int]], max_new: int) -> list[Request]:
    """Request j gets sampling stream j, at every batch size (and in the batch-1 answers)."""
    return [Request(j, list(p), max_new, seed=j) for j, p in enumerate(prompts)]


_compile_events = 0  # JAX traces, lowerings and compiles so far in this process
_compile_seconds = 0.0  # what they took (a program loaded from the compile cache: its load;
# programs compiled ahead, several at once: the wall time of all of them)
_programs_compiled = 0  # programs XLA compiled, or loaded from either cache
_ahead = 0  # compile_ahead calls running
_lock = threading.Lock()  # the listener hears compiles from compile_ahead's threads
# disjoint phases, their sum the time spent compiling; the last two each end a program: an
# XLA compile (or JAX's cache's load after tracing and lowering), or a whole executable
# loaded (decode/executables.py: nothing traced), whose kept copy is written after
_COMPILE_PHASES = ("/jax/core/compile/jaxpr_trace_duration",
                   "/jax/core/compile/jaxpr_to_mlir_module_duration",
                   executables.SAVE, "/jax/core/compile/backend_compile_duration",
                   executables.LOAD)


def _count_compiles(event: str, duration: float, **_: Any) -> None:
    global _compile_events, _compile_seconds, _programs_compiled
    with _lock:
        if event.startswith(("/jax/core/compile/", "/jax/compilation_cache/",
                             "/eagle3kit/executables/")):
            _compile_events += 1
        if event in _COMPILE_PHASES:
            _compile_seconds += 0.0 if _ahead else duration
            _programs_compiled += event in _COMPILE_PHASES[-2:]


jax.monitoring.register_event_duration_secs_listener(_count_compiles)
_cache_hits = 0  # programs JAX's persistent compile cache served (jobs/common.compile_cache)
_executable_hits = 0  # programs loaded whole from the executables kept beside it


def _count_hits(event: str, **_: Any) -> None:
    global _cache_hits, _executable_hits
    with _lock:
        _cache_hits += event == "/jax/compilation_cache/cache_hits"
        _executable_hits += event == executables.HIT


jax.monitoring.register_event_listener(_count_hits)


def cache_hits() -> tuple[int, int]:
    """(Programs XLA's compile of which JAX's persistent cache served, programs loaded whole
    from the kept executables, neither traced nor lowered) so far in this process."""
    return _cache_hits, _executable_hits


def compile_totals() -> tuple[float, int]:
    """(seconds JAX spent tracing, lowering and compiling, programs compiled) so far in this
    process: the difference over a stretch of work is what it compiled."""
    return _compile_seconds, _programs_compiled


def compile_ahead(compilers: Sequence[Callable[[], Any]]) -> None:
    """Runs `compilers` (Engine.compilers' thunks) in threads, so that XLA compiles several
    programs at once; compile_totals counts their wall time, not the sum of their times."""
    global _ahead, _compile_seconds
    if not compilers:
        return
    t0, before = time.perf_counter(), _compile_events
    with _lock:
        _ahead += 1
    try:
        with ThreadPoolExecutor(min(len(compilers), os.cpu_count() or 1)) as pool:
            for job in [pool.submit(c) for c in compilers]:
                job.result()
    finally:
        with _lock:
            _ahead -= 1
            if _compile_events != before:  # else all were compiled already: none counted
                _compile_seconds += time.perf_counter() - t0


def timed_call(fn: Any) -> tuple[Any, float, bool]:
    """fn()'s result, its seconds and whether JAX traced or compiled anything meanwhile (then
    the seconds include compiling: run it again to time it)."""
    before = _compile_events
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0, _compile_events != before


def timed(engine: Engine, todo: list[Request]) -> tuple[list, list[float], int]:
    """(completions, [seconds], device steps) of `engine` generating `todo`, run again while
    a run compiles (a new engine's first run does: the second takes the same shapes)."""
    for _ in range(3):
        before = engine.device_steps
        done, seconds, compiled = timed_call(lambda: engine.generate(todo))
        if not compiled:
            break
    return done, [seconds], engine.device_steps - before


def point(batch: int, dec: DecodeConfig, done, seconds: float, steps: int, plain_tps: float,
          plain_answers: list[list[int]], plain_steps: int) -> dict[str, Any]:
    """One measured point: tau (pooled and per request), tokens/s both ways, speedup."""
    summary = acceptance_summary([c.accept_lengths for c in done], dec.steps)
    tps = sum(len(c.tokens) for c in done) / seconds
    identical = sum(c.tokens == p for c, p in zip(done, plain_answers, strict=True))
    return {"batch": batch, "shape": shape_name(dec), "steps": dec.steps, "topk": dec.topk,
            "draft_tokens": dec.nodes, "tau_pooled": summary["tau_pooled"],
            "tau_per_request_mean": summary["tau_per_request_mean"],
            "verify_steps": summary["verify_steps"],
            # device steps run: the work both sides did (decode/steps.run_steps)
            "speculative_steps": steps, "baseline_steps": plain_steps,
            "tokens_per_s_speculative": round(tps, 2),
            "tokens_per_s_baseline": round(plain_tps, 2),
            "speedup": round(tps / plain_tps, 4),
            "identical_to_baseline": identical if dec.temperature == 0 else None}


def measure(setup: Setup, prompts: Sequence[Sequence[int]], batches: Sequence[int],
            sweep: Sequence[DecodeConfig] | None, console) -> dict[str, Any]:
    """{"concurrency": [one entry per batch size, the run's own shape]} and, with a sweep,
    {"sweep": [every shape x batch], "best": {batch: entry}, "best_chain": ...}."""
    base = setup.draft.dec
    shapes = [base] + [d for d in (sweep or []) if d != base]
    slots = setup.slots = max(setup.slots, slots_for(prompts, base.max_new_tokens, shapes))
    todo = requests(prompts, base.max_new_tokens)
    points: list[dict[str, Any]] = []
    for b in batches:
        plain, seconds, plain_steps = timed(setup.engine(b, slots, None), todo)
        plain_tps = sum(len(c.tokens) for c in plain) / seconds[0]
        for dec in shapes if sweep else shapes[:1]:
            done, seconds, steps = timed(setup.engine(b, slots, dec), todo)
            e = point(b, dec, done, seconds[0], steps, plain_tps, [c.tokens for c in plain],
                      plain_steps)
            console.print(f"batch {b:>3} {e['shape']:>7}: tau {e['tau_pooled']:.2f}  "
                          f"{e['tokens_per_s_speculative']:,.1f} vs "
                          f"{plain_tps:,.1f} tok/s  {e['speedup']:.2f}x")
            points.append(e)
    out: dict[str, Any] = {"concurrency": [p for p in points if p["shape"] ==
                                           shape_name(base)]}
    if sweep:
        # every shape measured, the run's own included where the grid does not name it:
        # it is the shape the export serves, the one the others are read against
        grid = points
        out["sweep"] = grid
        out["best"] = best_per_batch(grid)
        chains = [p for p in grid if p["topk"] == 1]
        out["best_chain"] = best_per_batch(chains) if chains else {}
    return out
