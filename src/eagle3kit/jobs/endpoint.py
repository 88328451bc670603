"""`regenerate --endpoint URL`: the same turns, answered by an OpenAI-compatible server.

Serving teams already run vLLM or SGLang; pointing `regenerate` at such a server spreads the
work over its GPUs with nothing loaded here. Each conversation is one worker's job: its turns
go to `POST /v1/chat/completions` in order (the server applies the model's chat template;
`--thinking` is passed as `chat_template_kwargs.enable_thinking`), `--concurrency`
requests in flight on worker threads. The conversation loop is the local engine's
(decode/conversations.drive): `Server` offers the engine's `step(queue)`, so next turns of
started conversations go first, records are written in input order as they finish and
`--resume` works as with the local engine.

Failures: a refused prompt (HTTP 400, typically longer than the server's context) ends that
conversation where it stands, counted like a prompt over --max-context. A connection error,
timeout, 429 or 5xx is retried with exponential backoff; after `--retries` the run stops
with exit 4, keeping every record written (resume once the server is back).
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import json
import queue
import threading
import time
import urllib.error
import urllib.request
from typing import Any

from eagle3kit.data.records import ChatRecord, GenerationInfo
from eagle3kit.decode import conversations as conv
from eagle3kit.errors import ResourceError
from eagle3kit.jobs import regen_work as job
from eagle3kit.jobs.preempt import Preempted, Preemption


class Refused(Exception):
    """The server answered 400: this prompt cannot be served."""


class Client:
    """A minimal OpenAI-compatible chat client (stdlib only) with retries and backoff."""

    def __init__(self, base: str, timeout: float, retries: int):
        self.base = base.rstrip("/")
        if not self.base.endswith("/v1"):
            self.base += "/v1"
        self.timeout, self.retries = timeout, retries

    def _call(self, path: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.base + path, data=data,
                                     headers={"Content-Type": "application/json"})
        delay = 0.5
        for attempt in range(self.retries + 1):
            try:
                with urllib.request.urlopen(req, timeout=self.timeout) as r:
                    return json.loads(r.read())
            except urllib.error.HTTPError as e:
                if e.code == 400:
                    raise Refused(_message(e)) from None
                error = f"HTTP {e.code} {_message(e)}"
                if e.code not in (408, 429) and e.code < 500:
                    raise ResourceError(f"{self.base}{path}: {error}") from None
            except (urllib.error.URLError, TimeoutError, ConnectionError, OSError) as e:
                error = str(getattr(e, "reason", e))
            if attempt < self.retries:
                time.sleep(delay)
                delay = min(delay * 2, 30.0)
        raise ResourceError(f"{self.base}{path}: {error} (after {self.retries} retries)")

    def models(self) -> list[str]:
        return [m["id"] for m in self._call("/models").get("data", [])]

    def chat(self, body: dict[str, Any]) -> dict[str, Any]:
        return self._call("/chat/completions", body)


def _message(e: urllib.error.HTTPError) -> str:
    try:
        detail = json.loads(e.read())
        detail = detail.get("error", detail)
        return str(detail.get("message", detail) if isinstance(detail, dict) else detail)[:200]
    except Exception:
        return e.reason or ""


def answer(client: Client, body: dict[str, Any]) -> tuple[str, int, int, str]:
    """(text, prompt tokens, new tokens, finish reason) of one turn."""
    out = client.chat(body)
    choice = out["choices"][0]
    message = choice.get("message") or {}
    text = message.get("content") or ""
    reasoning = message.get("reasoning_content") or message.get("reasoning")
    if reasoning:  # servers with a reasoning parser split the think block off
        text = f"<think>\n{reasoning.strip()}\n</think>\n\n{text.lstrip()}"
    usage = out.get("usage") or {}
    reason = "length" if choice.get("finish_reason") == "length" else "stop"
    return text, int(usage.get("prompt_tokens", 0)), int(usage.get("completion_tokens", 0)), \
        reason


@dataclasses.dataclass
class Asked:
    """One turn sent to the server (the engine's `Request` for it)."""

    handle: Any
    body: dict[str, Any]


@dataclasses.dataclass
class Answered:
    """What came back (the engine's `Completion` for it): the answer, or why it was refused."""

    handle: Any
    text: str = ""
    prompt_tokens: int = 0
    new_tokens: int = 0
    finish_reason: str = "stop"
    refused: str | None = None  # the server's message when it answered 400


class Server:
    """An OpenAI-compatible server behind the engine's interface: `step(queue)` sends turns
    from the left of `queue` while fewer than `concurrency` are in flight (daemon threads: a
    stop never waits on them), waits up to `poll_s` for answers and returns those that came.
    A connection failure after the client's retries is raised here."""

    def __init__(self, client: Client, concurrency: int, poll_s: float = 0.2):
        self.client, self.concurrency, self.poll_s = client, concurrency, poll_s
        self.todo: queue.Queue = queue.Queue()
        self.results: queue.Queue = queue.Queue()
        self.in_flight = 0
        self.threads: list[threading.Thread] = []

    @property
    def busy(self) -> bool:
        return self.in_flight > 0

    @property
    def free_rows(self) -> int:
        return self.concurrency - self.in_flight

    def _work(self) -> None:
        while True:
            asked = self.todo.get()
            try:
                text, prompt_len, new, reason = answer(self.client, asked.body)
                self.results.put((Answered(asked.handle, text, prompt_len, new, reason), None))
            except Refused as e:
                self.results.put((Answered(asked.handle, refused=str(e)), None))
            except Exception as e:  # the main thread stops the run with it
                self.results.put((None, e))

    def step(self, pending: collections.deque) -> list[Answered]:
        while pending and self.in_flight < self.concurrency:
            self.todo.put(pending.popleft())
            self.in_flight += 1
            if len(self.threads) < self.in_flight:
                self.threads.append(threading.Thread(target=self._work, daemon=True))
                self.threads[-1].start()
        done = []
        try:
            done.append(self.results.get(timeout=self.poll_s))
            while True:
                done.append(self.results.get_nowait())
        except queue.Empty:
            pass
        out = []
        for answered, error in done:
            self.in_flight -= 1
            if error is not None:
                raise error
            out.append(answered)
        return out


def run(cfg, records: list[ChatRecord], done: collections.Counter,
        previous: GenerationInfo | None, counts, console, make_progress,
        earlier: collections.Counter | None = None):
    """Answers the work through the server at --endpoint; `make_progress(console, total)` is
    the job's progress display (jobs/regenerate.Progress), given by the job that picked this
    backend."""
    client = Client(cfg.endpoint, cfg.timeout, cfg.retries)
    models = client.models()  # fails in seconds when nothing listens there
    model = cfg.model or (models[0] if models else cfg.target)
    # the model, not the address: a restarted server elsewhere continues the same run
    digest = hashlib.sha256(f"endpoint\0{model}".encode()).hexdigest()[:16]
    # a server's answers come whole: no repetition check
    info = job.generation_info(cfg, model, digest, cfg.max_context or 0, repetition=False)
    job.check_resume(cfg, info, previous)
    work = job.plan_work(records, done, cfg.turns == "first", cfg.samples, counts, earlier)
    console.print(f"regenerate with {model} at {client.base}, {cfg.concurrency} "
                  "conversations at a time", soft_wrap=True)

    def request(w: job.Work, msgs) -> Asked:
        b = {"model": model, "messages": [{"role": m.role, "content": m.content}
                                          for m in msgs],
             "temperature": cfg.temperature, "top_p": cfg.top_p,
             "max_tokens": cfg.max_new_tokens, "seed": w.seed(len(w.dialogue.turns))}
        if cfg.top_k:
            b["top_k"] = cfg.top_k  # vLLM's and SGLang's extension of the OpenAI API
        if cfg.thinking is not None:
            b["chat_template_kwargs"] = {"enable_thinking": cfg.thinking}
        return Asked((w, msgs), b)

    progress = make_progress(console, len(work))
    try:
        with job.output_stream(cfg) as stream, Preemption(console.print, at=job.STOP_AT) as stop, progress:
            writer = job.OrderedWriter(stream)
            runner = job.Runner(cfg, work, None, info, writer, counts, progress)

            def answered(w: job.Work, msgs, a: Answered) -> None:
                if a.refused is not None:  # this conversation ends where it stands
                    w.dialogue.stop(f"refused by the server ({a.refused})"
                                    if not w.dialogue.turns else conv.TOO_LONG)
                else:
                    runner.answered(w, a.text, a.prompt_tokens, a.new_tokens, a.finish_reason)

            def synced() -> None:
                if stop.requested:
                    raise Preempted(f"{stop.name}: stopped; finished conversations are "
                                    "written, --resume continues")
                progress.generated = counts.new_tokens

            try:
                conv.drive(Server(client, cfg.concurrency), work, lambda w: w.dialogue.prompt(),
                           request, answered, runner.finish, synced)
            except ResourceError as e:  # the server went away mid-run: say what is kept
                if cfg.out == "-" or not (counts.written or counts.resumed):
                    raise
                raise ResourceError(f"{e}; the records written so far are kept in "
                                    f"{job.partial_path(cfg.out)}: --resume once it answers"
                                    ) from None
            finally:
                writer.sync()
    finally:
        console.print(f"regenerate: {counts.summary()}; {progress.info()}", soft_wrap=True)
    return counts
