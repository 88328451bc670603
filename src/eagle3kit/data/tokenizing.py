"""`tokenize`: chat records in, token records out, on every core.

The parent reads lines and writes results; `jobs` worker processes decode, render (chat.py)
and encode batches of lines. `imap` keeps the input order, so the output is byte-identical
for any number of jobs. A worker never raises: it returns, per line, either the encoded
token record or why the line yields none, and the parent decides: a malformed line is an
`InputError` naming the file and line (or a counted skip with `skip_invalid`); a
conversation this template cannot render faithfully, or with nothing left to learn after
truncation, is a counted drop.
"""

from __future__ import annotations

import collections
import dataclasses
import multiprocessing
import os
import signal
import sys
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from eagle3kit.data.chat import Renderer, RenderError
from eagle3kit.data.records import TokenRecord, decode_chat, encode
from eagle3kit.errors import InputError, UserError

BATCH = 32  # lines per task: enough to amortise the inter-process hop


@dataclasses.dataclass
class TokenizeReport:
    records: int = 0
    written: int = 0
    truncated: int = 0
    tokens: int = 0
    masked: int = 0
    dropped: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    invalid: collections.Counter = dataclasses.field(default_factory=collections.Counter)


@dataclasses.dataclass(frozen=True)
class Job:
    """Everything a worker needs; the tokenizer travels by fork (or pickle under spawn)."""

    tokenizer: Any
    key: str
    where: str
    max_length: int | None
    chat_template: str | None = None
    thinking: bool | None = None


_worker: tuple[Job, Renderer] | None = None


def _init(job: Job) -> None:
    global _worker
    _worker = (job, Renderer(job.tokenizer, chat_template=job.chat_template,
                             thinking=job.thinking))


def _init_worker(job: Job) -> None:
    # the parent stops the pool on SIGTERM (pool.terminate sends it): a forked worker must
    # die of it, not run the parent's handler (cli/_common.py) and print a traceback
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    _init(job)


def _one(job: Job, renderer: Renderer, number: int, line: bytes) -> tuple:
    """("ok", line, n_tokens, n_masked, truncated) | ("drop" | "invalid", reason, message)."""
    try:
        chat = decode_chat(line, job.where, number)
    except InputError as e:
        return "invalid", "not a chat record", str(e)
    try:
        ids, mask = renderer.render(chat.messages)
    except RenderError as e:
        return "drop", e.reason, str(e)
    if not any(mask):
        return "drop", "no assistant turn", ""
    truncated = job.max_length is not None and len(ids) > job.max_length
    if truncated:
        ids, mask = ids[: job.max_length], mask[: job.max_length]
        if not any(mask):
            return "drop", "no assistant token within --max-length", ""
    data = encode(TokenRecord(chat.id, ids, mask, job.key))
    return "ok", data, len(ids), sum(mask), truncated


def _batch(lines: list[tuple[int, bytes]]) -> list[tuple]:
    job, renderer = _worker
    return [_one(job, renderer, n, line) for n, line in lines]


def _batches(lines: Iterable[tuple[int, bytes]]) -> Iterator[list[tuple[int, bytes]]]:
    batch = []
    for item in lines:
        batch.append(item)
        if len(batch) == BATCH:
            yield batch
            batch = []
    if batch:
        yield batch


def _context():
    # fork shares the loaded tokenizer for free (the CLI's case), but forking a process that
    # has loaded JAX (multithreaded) can deadlock; then, and off Linux, workers are spawned
    # and the tokenizer is pickled to each
    if sys.platform == "linux" and "jax" not in sys.modules:
        return multiprocessing.get_context("fork")
    return multiprocessing.get_context("spawn")


def tokenize_lines(lines: Iterable[tuple[int, bytes]], job: Job, *, jobs: int = 1,
                   skip_invalid: bool = False, report: TokenizeReport | None = None,
                   progress: Callable[[int], None] | None = None) -> Iterator[bytes]:
    """Encoded token records (JSONL lines) of `(line number, chat line)` pairs, in order.

    `report` is filled as the stream is consumed; `progress(n)` is called after each batch.
    """
    report = report if report is not None else TokenizeReport()
    if jobs <= 1:
        _init(job)
        results = map(_batch, _batches(lines))
        pool = None
    else:
        pool = _context().Pool(jobs, initializer=_init_worker, initargs=(job,))
        results = pool.imap(_batch, _batches(lines))
    try:
        for batch in results:
            for item in batch:
                report.records += 1
                kind = item[0]
                if kind == "ok":
                    _, data, n_tokens, n_masked, truncated = item
                    report.written += 1
                    report.tokens += n_tokens
                    report.masked += n_masked
                    report.truncated += truncated
                    yield data
                elif kind == "drop":
                    report.dropped[item[1]] += 1
                elif skip_invalid:
                    report.invalid[item[1]] += 1
                else:
                    raise InputError(f"{item[2]} (pass --skip-invalid to skip such lines)")
            if progress is not None:
                progress(len(batch))
    finally:
        if pool is not None:
            pool.terminate()
            pool.join()


def make_renderer(tokenizer: Any, chat_template: str | None, thinking: bool | None,
                  target: object = None) -> Renderer:
    """The renderer of the --chat-template `chat_template` (a file or a known name), else of
    `tokenizer`'s own template (a tokenizer without one, a base model, is refused naming the
    option); a template's errors name its file (a Jinja syntax error shows only when
    rendering). --thinking/--no-thinking (`thinking` not None) on a template without a
    thinking switch is refused, not silently ignored."""
    from eagle3kit.data.tokenizer import chat_template_for, load_chat_template

    template = load_chat_template(chat_template) if chat_template else None
    template = chat_template_for(tokenizer, template, target)
    try:
        renderer = Renderer(tokenizer, chat_template=template, thinking=thinking)
        switch = thinking is None or renderer.has_thinking_switch()
    except RenderError as e:
        if chat_template:
            raise InputError(str(e), path=chat_template) from None
        raise
    if not switch:
        whose = (f"--chat-template {chat_template}" if chat_template
                 else f"the chat template of {target or 'the tokenizer'}")
        option = "--thinking" if thinking else "--no-thinking"
        raise UserError(f"{option}: {whose} has no thinking switch (it ignores "
                        f"enable_thinking); leave {option} out")
    return renderer


def default_jobs() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS
        return os.cpu_count() or 1
