"""`eval --concurrency` and `eval --sweep`: speculative decoding at serving batch sizes.

For each batch size B the answered prompts of the batch-1 run (every turn's prompt, with the
earlier turns' answers in it) are decoded twice, both with continuous refill of B rows:
speculatively (decode/spec_engine.py) and plainly (decode/engine.py, the target alone), same
prompts, same max_new_tokens, so the speedup at B is measured, not assumed. Each run is done
once untimed first (it compiles every program shape the timed run uses: the same requests
take the same shapes), then timed end to end.

`--sweep` repeats the speculative half over a grid of drafting shapes (the plain baseline of
each B is measured once) and names the fastest shape per B by measured speedup.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from typing import Any

from eagle3kit.decode.engine import Engine, EngineConfig, Request, Sampling
from eagle3kit.decode.runner import Decoder, acceptance_summary
from eagle3kit.decode.spec_engine import SpecEngine, SpecEngineConfig
from eagle3kit.decode.speculative import DecodeConfig
from eagle3kit.errors import UserError

# chains K = 3, 5, 7 and SGLang-style trees S/k/N
DEFAULT_SWEEP = "3;5;7;3/4/8;5/4/8;5/8/16"
SPEC_SYNC = 8  # verify steps per device program (each emits 1..K+1 tokens)
PLAIN_SYNC = 32  # plain decode steps per device program


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


def _slots(prompts: Sequence[Sequence[int]], max_new: int, decs: Sequence[DecodeConfig]) -> int:
    need = max(len(p) for p in prompts) + max_new + max(max(d.steps, d.nodes) for d in decs) + 1
    return -(-need // 128) * 128


def _timed(engine, requests: list[Request], counter: str) -> tuple[Any, float, int]:
    """(completions, seconds, device steps) of `engine` generating `requests`, timed on the
    second run: the first compiles every shape (the same requests take the same shapes)."""
    engine.generate(requests)
    before = getattr(engine, counter)
    t0 = time.perf_counter()
    done = engine.generate(requests)
    return done, time.perf_counter() - t0, getattr(engine, counter) - before


def _requests(prompts: Sequence[Sequence[int]], max_new: int, seed: int) -> list[Request]:
    return [Request(j, list(p), max_new, seed=seed + j) for j, p in enumerate(prompts)]


def plain_speed(decoder: Decoder, prompts: Sequence[Sequence[int]], batch: int, slots: int,
                seed: int) -> tuple[float, list[list[int]], int]:
    """(tokens/s, answers, decode steps of the timed run) of the target alone with `batch`
    rows. Its device programs end as the speculative engine's do (decode/engine.py): no step
    runs once every row is done, so both sides do the same useful work and the speedup cannot
    exceed tau for want of work on the baseline side."""
    dec = decoder.dec
    engine = Engine(decoder.tcfg, decoder.target_w, decoder.mesh,
                    [int(s) for s in decoder.stop_ids if s >= 0],
                    EngineConfig(rows=batch, max_context=slots, sync_every=PLAIN_SYNC,
                                 sampling=Sampling(dec.temperature), seed=seed))
    requests = _requests(prompts, dec.max_new_tokens, seed)
    done, seconds, steps = _timed(engine, requests, "decode_steps")
    return sum(len(c.tokens) for c in done) / seconds, [c.tokens for c in done], steps


def spec_speed(decoder: Decoder, dec: DecodeConfig, prompts: Sequence[Sequence[int]],
               batch: int, slots: int, seed: int, plain_tps: float,
               plain_answers: list[list[int]], plain_steps: int) -> dict[str, Any]:
    """One measured point: tau (pooled and per request), tokens/s both ways, speedup."""
    engine = SpecEngine(decoder.tcfg, decoder.dcfg, decoder.target_w, decoder.draft_w,
                        decoder.vocab, dec, [int(s) for s in decoder.stop_ids if s >= 0],
                        decoder.mesh, SpecEngineConfig(rows=batch, max_context=slots,
                                                       sync_every=SPEC_SYNC))
    requests = _requests(prompts, dec.max_new_tokens, seed)
    done, seconds, steps = _timed(engine, requests, "verify_steps")
    summary = acceptance_summary([c.accept_lengths for c in done], dec.steps)
    tps = sum(len(c.tokens) for c in done) / seconds
    identical = sum(c.tokens == p for c, p in zip(done, plain_answers, strict=True))
    return {"batch": batch, "shape": shape_name(dec), "steps": dec.steps, "topk": dec.topk,
            "draft_tokens": dec.nodes, "tau_pooled": summary["tau_pooled"],
            "tau_per_request_mean": summary["tau_per_request_mean"],
            "verify_steps": summary["verify_steps"],
            # device steps run: the work both sides did (decode/engine.run_steps)
            "speculative_steps": steps, "baseline_steps": plain_steps,
            "tokens_per_s_speculative": round(tps, 2),
            "tokens_per_s_baseline": round(plain_tps, 2),
            "speedup": round(tps / plain_tps, 4),
            "identical_to_baseline": identical if dec.temperature == 0 else None}


def measure(decoder: Decoder, prompts: Sequence[Sequence[int]], batches: Sequence[int],
            sweep: Sequence[DecodeConfig] | None, seed: int, console) -> dict[str, Any]:
    """{"concurrency": [one entry per batch size, the decoder's own shape]} and, with a
    sweep, {"sweep": [every shape x batch], "best": {batch: entry}, "best_chain": ...}."""
    shapes = [decoder.dec] + [d for d in (sweep or []) if d != decoder.dec]
    slots = _slots(prompts, decoder.dec.max_new_tokens, shapes)
    points: list[dict[str, Any]] = []
    for b in batches:
        plain_tps, answers, plain_steps = plain_speed(decoder, prompts, b, slots, seed)
        for dec in shapes if sweep else shapes[:1]:
            e = spec_speed(decoder, dec, prompts, b, slots, seed, plain_tps, answers,
                           plain_steps)
            console.print(f"batch {b:>3} {e['shape']:>7}: tau {e['tau_pooled']:.2f}  "
                          f"{e['tokens_per_s_speculative']:,.1f} vs "
                          f"{plain_tps:,.1f} tok/s  {e['speedup']:.2f}x")
            points.append(e)
    out: dict[str, Any] = {"concurrency": [p for p in points if p["shape"] ==
                                           shape_name(decoder.dec)]}
    if sweep:
        grid = [p for p in points if any(p["shape"] == shape_name(d) for d in sweep)]
        out["sweep"] = grid
        out["best"] = best_per_batch(grid)
        chains = [p for p in grid if p["topk"] == 1]
        out["best_chain"] = best_per_batch(chains) if chains else {}
    return out
