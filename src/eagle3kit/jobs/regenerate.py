"""The `regenerate` job: the target rewrites every assistant turn of the training data.

Conversations are read whole first (so bad input fails before any weight is loaded, and the
total is known), then answered turn by turn (decode/conversations.py) by the batched engine
(decode/engine.py) or an OpenAI-compatible server (jobs/endpoint.py). Records are written in
input order as soon as every conversation before them is done, flushed at once and fsynced
every few seconds, to `OUT.partial`, renamed to OUT once every conversation is done: a file
under the asked name is always complete. A kill loses at most the conversations in flight,
and `--resume` skips the ids already in the partial file (repairing a torn last line) and
continues. SIGINT and SIGTERM stop at the next sync, keep what is written and exit 75, like
`train` (jobs/preempt.py).

Sharding across hosts (`--shard I/N`): process I takes the I-th contiguous block of the input,
so `cat` of the N outputs in order is the whole run in input order.

Several answers per conversation (`--samples N`, sampling only): N records per input record,
one after the other, with ids `<id>#s0` .. `<id>#s<N-1>` (one sample: the input's id) and
each turn of sample k drawn from its own stream (`request_seed`; sample 0's is the one a run
of one sample uses). Answers that loop (decode/repetition.py) end where the loop completed,
with finish reason "repetition", and are kept or dropped as `--on-repetition` says.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import hashlib
import json
import time
from pathlib import Path
from typing import Any

from eagle3kit.data.chat import Renderer, RenderError
from eagle3kit.data.records import ChatRecord, GenerationInfo, display_name
from eagle3kit.decode import conversations as conv
from eagle3kit.decode.kv_attention import KVAttention, check_kv_attention, resolve_kv_attention
from eagle3kit.decode.sampling import sampling_problem
from eagle3kit.errors import InputError, UserError, plural
from eagle3kit.jobs import common
from eagle3kit.jobs.preempt import Preempted, Preemption
from eagle3kit.jobs.progress import per_second
from eagle3kit.jobs.regen_work import (
    DEFAULT_CONTEXT,
    ON_REPETITION,
    STOP_AT,
    TURNS,
    Counts,
    OrderedWriter,
    RegenerateConfig,
    Runner,
    Work,
    check_resume,
    generation_info,
    output_stream,
    partial_path,
    plan_work,
    read_input,
    repair_and_scan,
    resume_source,
)


def check_config(cfg: RegenerateConfig) -> tuple[int, int]:
    """Refuses option combinations that cannot work, before anything is read or loaded;
    returns the shard (index, count)."""
    if cfg.turns not in TURNS:
        raise UserError(f"--turns {cfg.turns!r}: choose all or first")
    if problem := sampling_problem(cfg.temperature, cfg.top_p, cfg.top_k):
        raise UserError(problem)
    if cfg.samples < 1:
        raise UserError(f"--samples {cfg.samples}: must be >= 1 (answers per conversation)")
    if cfg.samples > 1 and cfg.temperature == 0:
        raise UserError(f"--samples {cfg.samples} needs sampling: greedy answers are all the "
                        "same; pass --temperature > 0")
    if cfg.on_repetition not in ON_REPETITION:
        raise UserError(f"--on-repetition {cfg.on_repetition!r}: choose "
                        f"{', '.join(ON_REPETITION)}")
    if cfg.repeat_copies == 1 or cfg.repeat_copies < 0 or cfg.repeat_min_tokens < 1 \
            or cfg.repeat_max_block < 1:
        raise UserError("--repeat-copies must be >= 2 (or 0: no check), --repeat-min-tokens "
                        "and --repeat-max-block >= 1")
    if cfg.endpoint and cfg.on_repetition != "keep":
        raise UserError("--on-repetition: a server's answers come whole; loops are caught by "
                        "the local engine only (drop --endpoint or --on-repetition)")
    if cfg.max_new_tokens < 1 or (cfg.max_context is not None and cfg.max_context < 2):
        raise UserError("--max-new-tokens must be >= 1 and --max-context >= 2")
    if cfg.resume and cfg.out == "-":
        raise UserError("--resume continues an output file: pass -o FILE")
    if cfg.resume and cfg.force:
        raise UserError("--resume continues the output, --force starts it over: pick one")
    if cfg.out != "-" and not cfg.resume and not cfg.force and Path(cfg.out).exists() \
            and Path(cfg.out).stat().st_size > 0:
        raise UserError(f"{cfg.out}: already exists; pass --resume to continue it or --force "
                        "to start over")
    if cfg.out != "-" and not cfg.resume and not cfg.force and partial_path(cfg.out).exists():
        raise UserError(f"{partial_path(cfg.out)}: the records of an interrupted run; pass "
                        "--resume to continue it or --force to start over")
    if cfg.out != "-" and Path(cfg.out).is_dir():
        raise UserError(f"{cfg.out}: is a directory, expected a JSONL file")
    if cfg.endpoint and cfg.chat_template:
        raise UserError("--chat-template renders prompts for the local engine; with --endpoint "
                        "the server applies its own template")
    if cfg.chat_template:  # a missing file fails before any loading
        from eagle3kit.data.tokenizer import load_chat_template
        load_chat_template(cfg.chat_template)
    if cfg.slots < 1 or cfg.sync_every < 1 or cfg.concurrency < 1:
        raise UserError("--slots, --sync-every and --concurrency must be >= 1")
    check_kv_attention(cfg.kv_attention)
    if cfg.mixed_budget % MIXED_PIECE:
        raise UserError(f"--mixed-budget {cfg.mixed_budget}: a multiple of {MIXED_PIECE} "
                        "(the tokens of one prompt piece)")
    index, count = 0, 1
    if cfg.shard:
        i, _, n = cfg.shard.partition("/")
        if not (i.isdigit() and n.isdigit() and 0 <= int(i) < int(n)):
            raise UserError(f"--shard {cfg.shard!r}: expected I/N with 0 <= I < N, e.g. 0/8")
        index, count = int(i), int(n)
    return index, count


# ---- the run -----------------------------------------------------------------------------------


def target_digest(hf_config: dict[str, Any], tokenizer_key: str) -> str:
    blob = json.dumps(hf_config, sort_keys=True) + tokenizer_key
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def run_engine(runner: Runner, engine, tokenizer, stop_ids: set[int], stop: Preemption
               ) -> None:
    """Local generation: the conversation loop (decode/conversations.drive) over the engine,
    whose rows it keeps full."""
    from eagle3kit.decode.engine import Request

    cfg = runner.cfg

    def request(w: Work, ids: list[int]) -> Request:
        # share: a turn starts from the keys its conversation's rows hold (the last turn's
        # row, a sibling sample's first prompt) instead of prefilling them again
        return Request((w, ids), ids, min(cfg.max_new_tokens, cfg.max_context - len(ids)),
                       w.seed(len(w.dialogue.turns)), share=(w.record.id, w.occurrence))

    def answered(w: Work, ids: list[int], c) -> None:
        runner.answered(w, conv.answer_text(tokenizer, c.tokens, stop_ids), len(ids),
                        len(c.tokens), c.finish_reason)

    def synced() -> None:
        if stop.requested:
            raise Preempted(f"{stop.name}: stopped; finished conversations are written, "
                            "--resume continues")
        runner.progress.tokens(engine.generated_tokens)

    conv.drive(engine, runner.work, runner.prompt_ids, request, answered, runner.finish,
               synced)


MIXED_PIECE = 64  # tokens of one prompt piece in a mixed step (EngineConfig.mixed_piece)
PROGRESS_SECONDS = 30.0  # in logs, a progress line at most this often (and the last one)


class Progress:
    """Conversations done, generated tokens/s and ETA, through the shared progress display
    (jobs/progress.py: a live bar on a terminal, a plain line every PROGRESS_SECONDS
    otherwise). No token count until the first token (the bar says "compiling" until there
    is something to show), and the last conversation's line once, with every token counted."""

    def __init__(self, console, total: int):
        from eagle3kit.jobs.progress import Progress as Display

        self.display = Display(console, "regenerate", total, every=None,
                               seconds=PROGRESS_SECONDS)
        self.total, self.t0 = total, time.monotonic()
        self.done, self.generated = 0, 0

    def __enter__(self):
        self.display.__enter__()
        return self

    def __exit__(self, *exc):
        return self.display.__exit__(*exc)

    def info(self) -> str:
        seconds = max(time.monotonic() - self.t0, 1e-9)
        return f"{self.generated:,} tokens  {per_second(self.generated / seconds)} tok/s"

    def advance(self, counts: Counts) -> None:
        self.done += 1
        # the answers' tokens: every generated token once the last conversation is done
        self.generated = max(self.generated, counts.new_tokens)
        self._update()

    def tokens(self, generated: int) -> None:
        if generated == self.generated or self.done == self.total:
            return  # nothing new; the last conversation's line is already out
        self.generated = generated
        self._update()

    def _update(self) -> None:
        rate = self.done / max(time.monotonic() - self.t0, 1e-9)
        eta = (f"  eta {(self.total - self.done) / rate / 60:,.1f} min"
               if 0 < self.done < self.total else "")
        tokens = self.info() if self.generated else ""  # no "0 tokens" before the first
        self.display.update(self.done, info=(tokens + eta).strip())


def run(cfg: RegenerateConfig, console) -> Counts:
    """Regenerates as configured; returns the counts (also printed on stderr)."""
    shard = check_config(cfg)
    if cfg.target_dtype not in common.DTYPES:
        raise UserError(f"--target-dtype {cfg.target_dtype!r}: choose "
                        f"{' or '.join(common.DTYPES)}")
    records, earlier = read_input(cfg.input, cfg.limit, shard)  # bad input fails first
    if not records:
        raise InputError("no conversations to regenerate", path=display_name(cfg.input))
    done, previous = (repair_and_scan(resume_source(cfg)) if cfg.resume
                      else (collections.Counter(), None))
    counts = Counts(read=len(records), samples=cfg.samples)
    if cfg.endpoint:
        from eagle3kit.jobs import endpoint

        endpoint.run(cfg, records, done, previous, counts, console, Progress, earlier)
    else:
        run_local(cfg, records, done, previous, counts, console, earlier)
    if not counts.written and not counts.resumed:  # (output_stream left no empty file)
        raise InputError("no conversation could be regenerated (see the counts above)",
                         path=display_name(cfg.input))
    return counts


def run_local(cfg: RegenerateConfig, records: list[ChatRecord], done: collections.Counter,
              previous: GenerationInfo | None, counts: Counts, console,
              earlier: collections.Counter | None = None) -> None:
    """Generation with the batched engine on this machine's devices."""
    from eagle3kit.data.tokenizing import make_renderer
    from eagle3kit.io.hf import resolve_target
    from eagle3kit.jobs.evaluate import stop_ids

    tokenizer, key = common.target_tokenizer(cfg.target, required=True)
    renderer = make_renderer(tokenizer, cfg.chat_template, cfg.thinking, cfg.target)
    ckpt = resolve_target(cfg.target)
    positions = ckpt.config.max_position_embeddings
    if cfg.max_context is None:
        cfg = dataclasses.replace(cfg, max_context=min(DEFAULT_CONTEXT, positions))
    if cfg.max_context > positions:
        raise UserError(f"--max-context {cfg.max_context} exceeds the target's "
                        f"{positions} positions ({cfg.target})")
    info = generation_info(cfg, cfg.target, target_digest(ckpt.hf_config, key),
                           cfg.max_context, repetition=True)
    check_resume(cfg, info, previous)
    work = plan_work(records, done, cfg.turns == "first", cfg.samples, counts, earlier)
    stops = set(stop_ids(tokenizer, ckpt, renderer))  # eval's rule: eos and end of turn
    rows, context = cache_shape(cfg, work, renderer)
    memory = functools.partial(  # allocating the cache, or a program's temporaries
        common.out_of_memory, f"--slots {cfg.slots} x --max-context {cfg.max_context}"
        + (f" ({rows} x {context} for this input)"
           if (rows, context) != (cfg.slots, cfg.max_context) else ""),
        "lower --slots or --max-context (or add devices: --mesh)")
    # the records keep the options asked for (`info`); the engine and the turns' limits
    # work in the sized cache, which every planned turn fits
    cfg = dataclasses.replace(cfg, slots=rows, max_context=context)
    with memory():
        engine = make_engine(cfg, ckpt, stops, console)
        ahead = compile_programs(engine, cfg, work, console)
    progress = Progress(console, len(work))
    try:
        with memory(), output_stream(cfg) as stream, Preemption(console.print, at=STOP_AT) as stop, progress:
            writer = OrderedWriter(stream)
            runner = Runner(cfg, work, renderer, info, writer, counts, progress)
            try:
                run_engine(runner, engine, tokenizer, stops, stop)
            finally:
                writer.sync()
    finally:
        seconds = time.monotonic() - progress.t0
        console.print(f"regenerate: {counts.summary()}; {progress.info()} over "
                      f"{seconds:,.1f}s{compiled_since(ahead)}", soft_wrap=True)


def compiled_since(ahead: int | None) -> str:
    """The programs compiled while generating, after those compiled ahead (`ahead`: the
    count then; None: none were)."""
    if ahead is None:
        return ""
    from eagle3kit.jobs import eval_batched

    return f"; {plural(eval_batched.compile_totals()[1] - ahead, 'program')} compiled meanwhile"


MIN_POSITIONS = 256  # the sized cache's fewest positions (eval's engines' too: slots_for)


def _power_of_two(n: int) -> int:
    return 1 << (max(n, 1) - 1).bit_length()


def cache_shape(cfg: RegenerateConfig, work: list[Work], renderer: Renderer
                ) -> tuple[int, int]:
    """The KV cache the work needs, within --slots and --max-context: rows for the
    conversations, positions for the longest conversation can reach (its last prompt as
    written, original answers included, plus --max-new-tokens per answer: the answers it gets
    in place of the originals are at most that long), so a short job on a CPU does not
    allocate 64 x 4096 positions. Reading stops once --max-context is reached.

    Each rounds up to a power of two, less than twice what the work needs (positions: at
    least MIN_POSITIONS, as eval's caches): the cache's shape is a shape of every program
    the run compiles, so small runs that differ a little (the shards of a job, a --limit
    more or less, an eval of the target) share their programs through the compile cache
    instead of compiling their own."""
    rows = min(cfg.slots, _power_of_two(len(work)))
    longest, seen = 0, set()
    for w in work:
        d = w.dialogue
        if id(w.record) in seen or not d.answer_at:
            continue
        seen.add(id(w.record))
        try:
            prompt = len(renderer.prompt_ids(d.kept[: d.answer_at[-1]]))
        except RenderError:
            continue  # ends at its first turn (Runner.prompt_ids)
        turns = len(d.answer_at)
        # re-rendered answers may tokenize a little differently: a few tokens per turn
        longest = max(longest, prompt + turns * cfg.max_new_tokens + 8 * (turns - 1))
        if longest >= cfg.max_context:
            break
    return rows, min(cfg.max_context, max(MIN_POSITIONS, _power_of_two(longest)))


def compile_programs(engine, cfg: RegenerateConfig, work: list[Work], console) -> int | None:
    """Compiles the programs the run will meet ahead, several at once in threads (as `eval`
    does: XLA compiles without Python's lock), where they were compiled one at a time as
    each prompt shape first came up, every decoding row waiting; each is kept in the compile
    cache, so a later run loads them. Where the compile cache is (jobs/common.compile_cache:
    accelerators, a CPU only when asked): the prompts' lengths are not known ahead (later turns
    answer the generated ones), so every prefill shape a piece can take within the cache
    is compiled, first pieces and later ones (a turn that extends its row, a sample that
    copies its sibling's, a long prompt's next piece), and the row copy."""
    import os

    import jax

    from eagle3kit.decode.engine import MIN_PREFILL, bucket
    from eagle3kit.jobs import eval_batched

    if not jax.config.jax_compilation_cache_dir or (
            jax.default_backend() == "cpu" and not os.environ.get("EAGLE3KIT_COMPILE_CACHE")):
        return None
    low = min(MIN_PREFILL, engine.cfg.prefill_chunk)  # every bucket a piece can take
    top = bucket(min(engine.cfg.prefill_chunk, cfg.max_context - 1), low)
    lengths = [n for n in (low << k for k in range(32)) if n <= top]
    shared = cfg.samples > 1 or any(len(w.dialogue.answer_at) > 1 for w in work)
    t0, (_, before), hits = (time.perf_counter(), eval_batched.compile_totals(),
                             eval_batched.cache_hits())
    eval_batched.compile_ahead(engine.compilers(lengths, lengths if shared else ()))
    made = eval_batched.compile_totals()[1] - before
    loaded = sum(eval_batched.cache_hits()) - sum(hits)
    console.print(f"regenerate: {plural(made, 'program')} compiled ahead in "
                  f"{time.perf_counter() - t0:.1f}s ({loaded} of them loaded from disk)",
                  soft_wrap=True)
    return eval_batched.compile_totals()[1]


def make_engine(cfg: RegenerateConfig, ckpt, stops: set[int], console):
    import jax

    from eagle3kit.core.sharding import batch_ways, make_mesh
    from eagle3kit.core.target import unstack_in_place
    from eagle3kit.decode.engine import (
        Engine,
        EngineConfig,
        Sampling,
        check_memory,
        memory_estimate,
    )
    from eagle3kit.decode.repetition import Repetition
    from eagle3kit.io.hf import load_target

    common.compile_cache(console.print)
    mesh = make_mesh(cfg.mesh)
    if cfg.mixed_budget and batch_ways(mesh) > 1:
        raise UserError(f"--mixed-budget rides prompts in the steps of one data-parallel way, "
                        f"not {batch_ways(mesh)}: run one process per GPU with --shard I/N")
    attention = resolve_kv_attention(  # the one place `auto` is resolved for this run
        cfg.kv_attention, mesh.devices.flatten(), "run one process per GPU with --shard I/N "
        "(faster than one process over a mesh, docs/recipes.md)")
    # the cache sized to the work may hold fewer rows than the data axis has devices (two
    # conversations on a host of four GPUs): round up, the idle rows cost little memory
    ways = batch_ways(mesh)
    rows = -(-cfg.slots // ways) * ways
    engine_cfg = EngineConfig(
        rows=rows, max_context=cfg.max_context, sync_every=cfg.sync_every,
        mixed_budget=cfg.mixed_budget, mixed_piece=MIXED_PIECE,
        attention=attention,
        sampling=Sampling(cfg.temperature, cfg.top_p, cfg.top_k), seed=cfg.seed,
        # a block longer than the context / copies can never repeat: no arrays for it
        repetition=Repetition(cfg.repeat_copies, cfg.repeat_min_tokens,
                              min(cfg.repeat_max_block, max(1, cfg.max_context // 2)))
        if cfg.repeat_copies else None)
    dtype = common.DTYPES[cfg.target_dtype]
    # a cache that cannot fit even beside no weights is refused before they load (minutes
    # for a large target); the engine checks again with them in place
    check_memory(memory_estimate(ckpt.config, engine_cfg, dtype), mesh)
    t0 = time.perf_counter()
    # unstacked one array at a time: never two copies of the target at once
    weights = unstack_in_place(load_target(ckpt, mesh, dtype), ckpt.config)
    engine = Engine(ckpt.config, weights, mesh, sorted(stops), engine_cfg)
    console.print(f"regenerate with {ckpt.config.name} on {jax.device_count()} x "
                  f"{jax.devices()[0].device_kind} (mesh {','.join(f'{k}={v}' for k, v in mesh.shape.items())}; weights loaded "
                  f"in {time.perf_counter() - t0:.1f}s; {rows} slots x {cfg.max_context} "
                  f"positions, KV cache {engine.cache_bytes / 2**30:.2f} GiB"
                  f"{', read by the ragged kernel' if attention == KVAttention.PALLAS else ''})",
                  soft_wrap=True)
    return engine
