"""The JSONL records of the data pipeline, as msgspec Structs with reused encoders/decoders.

    mix         -> ChatRecord         {"id", "source", "messages": [{"role", "content"}]}
    regenerate  -> RegeneratedRecord  a ChatRecord plus "generation" (how it was made)
    tokenize    -> TokenRecord        {"id", "input_ids", "loss_mask", "tokenizer"}

A reader yields records one line at a time (memory stays flat however large the file) and
stops at the first bad line with an `InputError` that names the file and line. `-` reads stdin.
Formats are documented in docs/formats.md.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Annotated, Literal

import msgspec

from eagle3kit.errors import InputError

ROLES = ("system", "user", "assistant")


class Message(msgspec.Struct, frozen=True):
    role: Literal["system", "user", "assistant"]
    content: str


class ChatRecord(msgspec.Struct):
    """One conversation in the normalised schema (what `mix` writes, `tokenize` reads)."""

    id: str = ""
    source: str = ""
    messages: list[Message] = []


class TurnInfo(msgspec.Struct):
    """One regenerated answer: why it ended, its size in tokens and its sampling stream."""

    finish_reason: str  # "stop" (end-of-turn token), "length" (--max-new-tokens/context) or
    # "repetition" (its last tokens repeat one block: RepetitionRule)
    prompt_tokens: int
    new_tokens: int
    seed: int = 0  # the request's sampling stream (jobs/regen_work.request_seed)


class RepetitionRule(msgspec.Struct):
    """When an answer counts as looping (decode/repetition.py) and what became of it."""

    copies: int
    min_tokens: int
    max_block: int
    action: str  # keep | drop-answer | drop-conversation


class GenerationInfo(msgspec.Struct):
    """How a regenerated conversation was made (what `--resume` checks it continues)."""

    target: str  # as given (path, Hub id, or the model name at --endpoint)
    target_digest: str  # 16 hex digits over the target's config and tokenizer
    temperature: float
    top_p: float
    seed: int
    max_new_tokens: int
    max_context: int
    thinking: bool | None
    top_k: int = 0  # 0: no top-k cut
    samples: int = 1  # answers per input conversation
    sample: int = 0  # which of them this record is (its id ends in #s<sample> if samples > 1)
    repetition: RepetitionRule | None = None  # None: not checked
    turns: list[TurnInfo] = []

    def settings(self) -> dict:
        """Everything but the per-record facts: equal for every record of one run."""
        return {"target": self.target_digest, "temperature": self.temperature,
                "top-p": self.top_p, "top-k": self.top_k, "seed": self.seed,
                "max-new-tokens": self.max_new_tokens, "max-context": self.max_context,
                "thinking": self.thinking, "samples": self.samples,
                "repetition": self.repetition}


class RegeneratedRecord(msgspec.Struct):
    """A conversation whose assistant turns the target wrote (`eagle3kit regenerate`).

    Decodes as a `ChatRecord` too (unknown fields are ignored), so `tokenize` reads it as is.
    """

    id: str
    source: str
    messages: list[Message]
    generation: GenerationInfo


Bit = Annotated[int, msgspec.Meta(ge=0, le=1)]
TokenId = Annotated[int, msgspec.Meta(ge=0)]


class TokenRecord(msgspec.Struct):
    """One tokenized conversation: ids [T], loss mask [T] (1 = a token the draft learns to
    predict: assistant content and its end-of-turn token) and the tokenizer's `Fingerprint.key`."""

    id: str
    input_ids: list[TokenId]
    loss_mask: list[Bit]
    tokenizer: str


_ENCODER = msgspec.json.Encoder()
_CHAT = msgspec.json.Decoder(ChatRecord)
_TOKEN = msgspec.json.Decoder(TokenRecord)


def encode(record: msgspec.Struct) -> bytes:
    """One JSONL line (with the newline)."""
    return _ENCODER.encode(record) + b"\n"


def display_name(path: str | os.PathLike) -> str:
    return "<stdin>" if str(path) == "-" else str(path)


@contextlib.contextmanager
def open_input(path: str | os.PathLike) -> Iterator[IO[bytes]]:
    """Binary input; `-` is stdin. A missing file is an `InputError` naming it."""
    if str(path) == "-":
        if sys.stdin.isatty():  # waiting on a keyboard is never what was meant
            raise InputError("no input: stdin is a terminal; pass a file or pipe records in",
                             path="<stdin>")
        yield sys.stdin.buffer
        return
    p = Path(path)
    if p.is_dir():
        raise InputError("is a directory, expected a JSONL file", path=p)
    try:
        f = open(p, "rb")
    except FileNotFoundError:
        raise InputError("no such file", path=p) from None
    with f:
        yield f


def iter_lines(path: str | os.PathLike) -> Iterator[tuple[int, bytes]]:
    """(line number, line) of the non-blank lines of `path`."""
    with open_input(path) as f:
        for number, line in enumerate(f, start=1):
            if line.strip():
                yield number, line


def decode_chat(line: bytes, where: str, number: int) -> ChatRecord:
    """Parses one chat line; a missing `id` becomes `<file>:<line>`."""
    try:
        record = _CHAT.decode(line)
    except msgspec.DecodeError as e:
        raise InputError(f"not a chat record ({_why(e)}){_looks_like(line, 'chat')}",
                         path=where, line=number) from None
    if not record.messages:
        raise InputError(f"chat record has no messages{_looks_like(line, 'chat')}", path=where,
                         line=number)
    if not record.id:
        record.id = f"{Path(where).name}:{number}"
    return record


def decode_token(line: bytes, where: str, number: int) -> TokenRecord:
    try:
        record = _TOKEN.decode(line)
    except msgspec.DecodeError as e:
        raise InputError(f"not a token record ({_why(e)}){_looks_like(line, 'token')}",
                         path=where, line=number) from None
    if len(record.input_ids) != len(record.loss_mask):
        raise InputError(f"record {record.id!r}: {len(record.input_ids)} input_ids but "
                         f"{len(record.loss_mask)} loss_mask values", path=where, line=number)
    return record


def read_chat_records(path: str | os.PathLike) -> Iterator[ChatRecord]:
    """Chat records of a JSONL file (`-` = stdin), checked line by line."""
    where = display_name(path)
    for number, line in iter_lines(path):
        yield decode_chat(line, where, number)


def read_token_records(path: str | os.PathLike) -> Iterator[TokenRecord]:
    """Token records of a JSONL file (`-` = stdin), checked line by line."""
    where = display_name(path)
    for number, line in iter_lines(path):
        yield decode_token(line, where, number)


def _looks_like(line: bytes, wanted: str) -> str:
    """What a rejected line is instead, when it is another step's artifact: a user who feeds
    `mix` output to `vocab-select`, or raw ShareGPT to `tokenize`, is told the missing step."""
    try:
        keys = msgspec.json.decode(line)
    except msgspec.DecodeError:
        return ""
    if not isinstance(keys, dict):
        return ""
    if wanted == "token" and "messages" in keys:
        return "; it is a chat record: run `eagle3kit tokenize` on it first"
    if wanted == "chat" and "input_ids" in keys:
        return "; it is a token record, already tokenized"
    if wanted == "chat" and ("conversations" in keys or "conversation" in keys):
        return "; it is a raw dataset record: normalise it with `eagle3kit mix` first"
    return ""


def _why(e: msgspec.DecodeError) -> str:
    # msgspec says "JSON is malformed: ..." or "Expected `int`, got `str` - at `$.input_ids[3]`"
    return str(e) or "malformed JSON"


class GenerationSample(msgspec.Struct):
    """One answer of `eagle3kit eval --mode generate --samples FILE` (one record per turn).

    `prompt_ids` are exactly the ids fed to the target (chat template, generation prompt;
    a later turn's prompt holds the model's own earlier answers). `accept_lengths` holds the
    draft tokens accepted at each verify step: each step emits that many plus one token of the
    target's own, and the first generated token comes from the prefill.
    """

    id: str
    turn: int  # 1-based turn of the conversation
    prompt_ids: list[TokenId]
    generated_ids: list[TokenId]  # up to and including the stop token, if one came
    text: str  # generated_ids decoded, special tokens dropped
    accept_lengths: list[int]
    seconds: float  # speculative decoding of this turn (device time, compiled beforehand)
    baseline_seconds: float  # plain decoding of the same prompt
