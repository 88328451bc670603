"""`regenerate --endpoint URL`: the same turns, answered by an OpenAI-compatible server.

Serving teams already run vLLM or SGLang; pointing `regenerate` at such a server spreads the
work over its GPUs with nothing loaded here. Each conversation is one worker's job: its turns
go to `POST /v1/chat/completions` in order (the server applies the model's chat template;
`--thinking` is passed as `chat_template_kwargs.enable_thinking`), `--concurrency`
conversations at a time. Records are written in input order as they finish and `--resume`
works as with the local engine.

Failures: a refused prompt (HTTP 400, typically longer than the server's context) ends that
conversation where it stands, counted like a prompt over --max-context. A connection error,
timeout, 429 or 5xx is retried with exponential backoff; after `--retries` the run stops
with exit 4, keeping every record written (resume once the server is back).
"""

from __future__ import annotations

import collections
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
from eagle3kit.jobs import regenerate as job
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
        raise ResourceError(f"{self.base}{path}: {error} (after {self.retries} retries); the "
                            "records written so far are kept: --resume once it answers")

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


def run(cfg, records: list[ChatRecord], done: collections.Counter,
        previous: GenerationInfo | None, counts, console,
        earlier: collections.Counter | None = None):
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

    def body(w: job.Work, msgs) -> dict[str, Any]:
        b = {"model": model, "messages": [{"role": m.role, "content": m.content}
                                          for m in msgs],
             "temperature": cfg.temperature, "top_p": cfg.top_p,
             "max_tokens": cfg.max_new_tokens, "seed": w.seed(len(w.dialogue.turns))}
        if cfg.top_k:
            b["top_k"] = cfg.top_k  # vLLM's and SGLang's extension of the OpenAI API
        if cfg.thinking is not None:
            b["chat_template_kwargs"] = {"enable_thinking": cfg.thinking}
        return b

    def converse(w: job.Work) -> None:
        while (msgs := w.dialogue.prompt()) is not None:
            try:
                text, prompt_len, new, reason = answer(client, body(w, msgs))
            except Refused as e:
                w.dialogue.stop(f"refused by the server ({e})" if not w.dialogue.turns
                                else conv.TOO_LONG)
                return
            w.dialogue.answer(conv.Turn(text, prompt_len, new, reason))

    todo: queue.Queue = queue.Queue()
    results: queue.Queue = queue.Queue()
    for w in work:
        todo.put(w)

    def worker() -> None:
        while True:
            try:
                w = todo.get_nowait()
            except queue.Empty:
                return
            try:
                converse(w)
                results.put((w, None))
            except Exception as e:  # the main thread stops the run with it
                results.put((w, e))
                return

    threads = [threading.Thread(target=worker, daemon=True)  # a stop never waits on them
               for _ in range(min(cfg.concurrency, len(work)))]
    progress = job.Progress(console, len(work))
    try:
        with job.output_stream(cfg) as stream, Preemption(console.print, at=job.STOP_AT) as stop, progress:
            writer = job.OrderedWriter(stream)
            runner = job.Runner(cfg, work, None, info, writer, counts, progress)
            for t in threads:
                t.start()
            try:
                for _ in range(len(work)):
                    while True:
                        if stop.requested:
                            raise Preempted(f"{stop.name}: stopped; finished conversations "
                                            "are written, --resume continues")
                        try:
                            w, error = results.get(timeout=0.2)
                            break
                        except queue.Empty:
                            continue
                    if error is not None:
                        raise error
                    for t in w.dialogue.turns:
                        counts.answered(t)
                    progress.generated = counts.new_tokens
                    runner.finish(w)
            finally:
                writer.sync()
    finally:
        console.print(f"regenerate: {counts.summary()}; {progress.info()}", soft_wrap=True)
    return counts
