"""What a `regenerate` run is made of, whichever backend answers the turns: its settings, the
conversations to answer (`Work`), the records they become and the file they go to.

Both backends build on this module: the local engine (jobs/regenerate.py) and an
OpenAI-compatible server (jobs/endpoint.py); neither imports the other's internals, and
jobs/regenerate.py, which picks the backend, is the only module that imports both.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import os
import time
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import IO

import msgspec

from eagle3kit.data.chat import Renderer, RenderError
from eagle3kit.data.records import (
    ChatRecord,
    GenerationInfo,
    RegeneratedRecord,
    RepetitionRule,
    TurnInfo,
    encode,
    read_chat_records,
)
from eagle3kit.decode import conversations as conv
from eagle3kit.errors import InputError, MismatchError, plural

TURNS = ("all", "first")
ON_REPETITION = ("keep", "drop-answer", "drop-conversation")
STOP_AT = "the next sync, keeping every record written"  # what SIGINT/SIGTERM stop at
DEFAULT_CONTEXT = 4096  # prompt + answer; the KV cache holds --slots rows of this many


@dataclasses.dataclass(frozen=True)
class RegenerateConfig:
    target: str
    input: str = "-"
    out: str = "-"
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0
    samples: int = 1  # answers per conversation
    max_new_tokens: int = 2048
    max_context: int | None = None  # default: min(4096, the target's positions)
    turns: str = "all"
    thinking: bool | None = None
    chat_template: str | None = None
    drop_truncated: bool = False
    # repetition (local engine): `repeat_copies` copies of one block of at most
    # `repeat_max_block` tokens spanning `repeat_min_tokens`; 0 copies: not checked
    repeat_copies: int = 3
    repeat_min_tokens: int = 64
    repeat_max_block: int = 128
    on_repetition: str = "keep"
    limit: int | None = None
    shard: str | None = None  # "I/N"
    resume: bool = False
    force: bool = False
    # local engine
    slots: int = 64
    sync_every: int = 32
    mixed_budget: int = 0  # EngineConfig.mixed_budget: prompt tokens a decode step carries
    mesh: str | None = None
    target_dtype: str = "bfloat16"
    kv_attention: str = "auto"  # EngineConfig.attention, or auto (decode/engine.py)
    # remote server
    endpoint: str | None = None
    model: str | None = None
    concurrency: int = 16
    timeout: float = 600.0
    retries: int = 5


def _reasons(counter: collections.Counter) -> str:
    return ", ".join(f"{n:,} {reason}" for reason, n in counter.most_common())


@dataclasses.dataclass
class Counts:
    read: int = 0
    samples: int = 1
    resumed: int = 0  # already in the output
    written: int = 0
    turns: int = 0
    finished: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    ended_early: collections.Counter = dataclasses.field(  # kept up to a turn that could not
        default_factory=collections.Counter)  # be answered (why)
    new_tokens: int = 0
    dropped: collections.Counter = dataclasses.field(default_factory=collections.Counter)

    def answered(self, turn: conv.Turn) -> None:
        self.turns += 1
        self.new_tokens += turn.new_tokens
        self.finished[turn.finish_reason] += 1

    def summary(self) -> str:
        drops = sum(self.dropped.values())
        early = sum(self.ended_early.values())
        return (f"{plural(self.read, 'conversation')} read"
                + (f" ({self.samples} samples each)" if self.samples > 1 else "")
                + f": {self.written:,} written"
                + (f", {self.resumed:,} already in the output" if self.resumed else "")
                + (f", {drops:,} dropped ({_reasons(self.dropped)})" if drops else "")
                + f"; {plural(self.turns, 'answer')} ({plural(self.new_tokens, 'token')}"
                + (f"; ended by {_reasons(self.finished)})" if self.turns else ")")
                + (f"; {plural(early, 'conversation ends', 'conversations end')} early "
                   f"({_reasons(self.ended_early)})"
                   if early else ""))



# ---- input, resume, output -------------------------------------------------------------------


def read_input(path: str, limit: int | None, shard: tuple[int, int]
               ) -> tuple[list[ChatRecord], collections.Counter]:
    """This shard's block of the input, and how often each id occurs before the block (a
    repeated id's sampling stream counts its occurrences in the whole input)."""
    records = []
    for r in read_chat_records(path):
        records.append(r)
        if limit and len(records) >= limit:
            break
    index, count = shard
    per = -(-len(records) // count)
    earlier = collections.Counter(r.id for r in records[: index * per])
    return records[index * per: (index + 1) * per], earlier


def repair_and_scan(path: Path) -> tuple[collections.Counter, GenerationInfo | None]:
    """Cuts a torn last line off `path` (a kill mid-write) and counts the ids already there;
    returns them with the first record's settings."""
    done: collections.Counter = collections.Counter()
    first = None
    if not path.exists():
        return done, None
    with open(path, "rb+") as f:
        data = f.read()
        end = data.rfind(b"\n") + 1
        if end < len(data):
            f.truncate(end)
            f.flush()
            os.fsync(f.fileno())
    decoder = msgspec.json.Decoder(RegeneratedRecord)
    for number, line in enumerate(data[:end].splitlines(), start=1):
        if not line.strip():
            continue
        try:
            r = decoder.decode(line)
        except msgspec.DecodeError as e:
            raise InputError(f"not a regenerated record ({e}); --resume continues a file "
                             "`regenerate` wrote", path=path, line=number) from None
        done[r.id] += 1
        first = first or r.generation
    return done, first


class OrderedWriter:
    """Writes finished conversations in input order, each the moment all before it are done.

    Lines are flushed as written and fsynced at most every `sync_s` seconds and on close.
    """

    def __init__(self, stream: IO[bytes], sync_s: float = 5.0):
        self.stream, self.sync_s = stream, sync_s
        self.next = 0
        self.ready: dict[int, bytes | None] = {}
        self._synced = time.monotonic()

    def put(self, index: int, line: bytes | None) -> int:
        """Conversation `index` is done (None: dropped); returns lines written now."""
        self.ready[index] = line
        written = 0
        while self.next in self.ready:
            out = self.ready.pop(self.next)
            self.next += 1
            if out is not None:
                self.stream.write(out)
                written += 1
        if written:
            self.stream.flush()
            if time.monotonic() - self._synced > self.sync_s:
                self.sync()
        return written

    def sync(self) -> None:
        self.stream.flush()
        with contextlib.suppress(OSError, ValueError):  # a pipe cannot be fsynced
            os.fsync(self.stream.fileno())
        self._synced = time.monotonic()


def partial_path(out: str | os.PathLike) -> Path:
    """Where records go until the run is complete: OUT.partial beside OUT."""
    return Path(f"{out}.partial")


def resume_source(cfg: RegenerateConfig) -> Path:
    """What --resume continues: the partial file of an interrupted run, else a complete OUT
    (resumed with a larger --limit, say)."""
    partial = partial_path(cfg.out)
    return partial if partial.exists() else Path(cfg.out)


@contextlib.contextmanager
def output_stream(cfg: RegenerateConfig) -> Iterator[IO[bytes]]:
    """Stdout, or OUT.partial (appended to with --resume), renamed to OUT only when the
    block ends without an error: an interrupted run never leaves a short file under OUT."""
    import shutil
    import sys

    from eagle3kit.io.atomic import fsync_dir

    if cfg.out == "-":
        yield sys.stdout.buffer
        return
    path = Path(cfg.out)
    partial = partial_path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if cfg.resume and not partial.exists() and path.exists():
        shutil.copyfile(path, partial)  # a complete OUT stays whole until the longer one is
    f = open(partial, "ab" if cfg.resume else "wb")  # closed on every path below
    try:
        yield f
        f.flush()
        os.fsync(f.fileno())
    finally:
        f.close()
        # an empty file records nothing (every conversation dropped, or none answered
        # before an error): removed, and an earlier OUT stays as it was; records made
        # before an error stay in the partial file for --resume
        if partial.stat().st_size == 0:
            partial.unlink()
    if not partial.exists():
        return
    os.replace(partial, path)
    fsync_dir(path.parent)


def request_seed(cid: str, occurrence: int, turn: int, sample: int = 0) -> int:
    """A sampling stream per conversation turn and sample, independent of batching, sharding
    and resume (sample 0's is the stream of a run with one sample)."""
    key = f"{cid}\0{occurrence}\0{turn}" + (f"\0{sample}" if sample else "")
    return zlib.crc32(key.encode())


def sample_id(cid: str, sample: int, samples: int) -> str:
    """The output id of one sample: the input's id, with `#s<sample>` when there are several."""
    return f"{cid}#s{sample}" if samples > 1 else cid


LOOP_DROPPED = "a looping answer dropped (--on-repetition drop-answer)"
LOOP_DROPS = "a looping answer (--on-repetition drop-conversation)"


@dataclasses.dataclass
class Work:
    """One conversation to answer: its place in the input, which sample, and its dialogue."""

    index: int
    record: ChatRecord
    occurrence: int  # how many earlier records share its id
    sample: int
    id: str  # sample_id of it
    dialogue: conv.Dialogue

    def seed(self, turn: int) -> int:
        return request_seed(self.record.id, self.occurrence, turn, self.sample)


def plan_work(records: list[ChatRecord], done: collections.Counter, first_only: bool,
              samples: int, counts: Counts,
              earlier: collections.Counter | None = None) -> list[Work]:
    """The conversations still to answer, `samples` answers each: `done` counts each output
    id's occurrences already in the output, `earlier` each input id's occurrences in the input
    before this shard (a repeated id keeps the sampling stream of its place in the input)."""
    seen: collections.Counter = collections.Counter()
    work = []
    for r in records:
        occurrence = seen[r.id]
        seen[r.id] += 1
        for k in range(samples):
            out_id = sample_id(r.id, k, samples)
            if occurrence < done[out_id]:
                counts.resumed += 1
                continue
            work.append(Work(len(work), r, occurrence + (earlier or {}).get(r.id, 0), k,
                             out_id, conv.Dialogue(r.messages, first_only)))
    return work


def finish_record(w: Work, info: GenerationInfo, cfg: RegenerateConfig, counts: Counts
                  ) -> bytes | None:
    """The output line of a finished conversation, or None when it is dropped (counted)."""
    d = w.dialogue
    if not d.turns:
        counts.dropped[d.stop_reason or conv.NO_USER_TURN] += 1
        return None
    if cfg.drop_truncated and any(t.finish_reason == "length" for t in d.turns):
        counts.dropped["an answer cut at --max-new-tokens (--drop-truncated)"] += 1
        return None
    if cfg.on_repetition == "drop-conversation" and any(t.finish_reason == "repetition"
                                                        for t in d.turns):
        counts.dropped[LOOP_DROPS] += 1
        return None
    if d.stop_reason:
        counts.ended_early[d.stop_reason] += 1
    turns = [TurnInfo(t.finish_reason, t.prompt_tokens, t.new_tokens, w.seed(j))
             for j, t in enumerate(d.turns)]
    counts.written += 1
    return encode(RegeneratedRecord(w.id, w.record.source, d.messages(),
                                    msgspec.structs.replace(info, sample=w.sample,
                                                            turns=turns)))


def generation_info(cfg: RegenerateConfig, target: str, digest: str, max_context: int,
                    repetition: bool) -> GenerationInfo:
    """The settings every record of the run carries (`repetition`: loops are checked)."""
    rule = RepetitionRule(cfg.repeat_copies, cfg.repeat_min_tokens, cfg.repeat_max_block,
                          cfg.on_repetition) if repetition and cfg.repeat_copies else None
    return GenerationInfo(target, digest, cfg.temperature, cfg.top_p, cfg.seed,
                          cfg.max_new_tokens, max_context, cfg.thinking, top_k=cfg.top_k,
                          samples=cfg.samples, repetition=rule)


def check_resume(cfg: RegenerateConfig, info: GenerationInfo, previous: GenerationInfo | None
                 ) -> None:
    if previous is not None and previous.settings() != info.settings():
        was, now = previous.settings(), info.settings()
        diff = [f"{n} {was[n]!r} -> {now[n]!r}" for n in now if was[n] != now[n]]
        raise MismatchError(f"{cfg.out}: was made with other settings ({'; '.join(diff)}); "
                            "resume with the same options, or write a new file")


class Runner:
    """Drives the dialogues through a generation backend, writing records as they finish."""

    def __init__(self, cfg: RegenerateConfig, work: list[Work], renderer: Renderer,
                 info: GenerationInfo, writer: OrderedWriter, counts: Counts, progress):
        self.cfg, self.work, self.renderer, self.info = cfg, work, renderer, info
        self.writer, self.counts, self.progress = writer, counts, progress
        self._first: tuple[ChatRecord, list[int]] | None = None  # the last first prompt

    def prompt_ids(self, w: Work) -> list[int] | None:
        """The next turn's prompt ids, or None when the dialogue is over (or cannot go on)."""
        render = self.renderer.prompt_ids
        if not w.dialogue.turns:  # the samples of a record (next to each other in the
            # work) ask the same first prompt: rendered and tokenized once
            render = functools.partial(self._first_prompt, w.record)
        try:
            return conv.prompt_tokens(render, w.dialogue, self.cfg.max_context)
        except RenderError as e:
            w.dialogue.stop(f"the chat template refuses it ({e.reason})")
            return None

    def _first_prompt(self, record: ChatRecord, messages: list) -> list[int]:
        if self._first is None or self._first[0] is not record:
            self._first = (record, self.renderer.prompt_ids(messages))
        return list(self._first[1])

    def finish(self, w: Work) -> None:
        self.writer.put(w.index, finish_record(w, self.info, self.cfg, self.counts))
        self.progress.advance(self.counts)

    def answered(self, w: Work, text: str, prompt_len: int, new_tokens: int, reason: str
                 ) -> None:
        turn = conv.Turn(text, prompt_len, new_tokens, reason)
        self.counts.answered(turn)
        if reason == "repetition" and self.cfg.on_repetition == "drop-answer":
            w.dialogue.stop(LOOP_DROPPED)  # later turns would answer the dropped one
            return
        w.dialogue.answer(turn)
        if reason == "repetition" and self.cfg.on_repetition == "drop-conversation":
            w.dialogue.stop(LOOP_DROPS)  # dropped when finished: no more turns to generate


