"""Chat data sources: local `.jsonl`, `.json` (a top-level array), `.parquet` and `hf:` data sets,
normalised into `ChatRecord`s.

Recognised record shapes (`--format` overrides detection):

    sharegpt / perfectblend   {"id"?, "conversations": [{"from": "human"|"gpt"|..., "value"}]}
    openai / ultrachat        {"id"|"prompt_id"?, "messages": [{"role", "content"}]}

Every reader streams: JSONL line by line, JSON arrays one element at a time from a buffer
(so a file cut off mid-record still yields every complete record, and the unreadable tail
is reported), parquet one row group batch at a time, `hf:` through `datasets` streaming.

Errors: a file that cannot be read at all is an `InputError` naming it; a record that is
malformed or of unknown shape is a `RecordError` naming the file and line (or record),
which the caller raises, or counts and skips with `--skip-invalid`.
"""

from __future__ import annotations

import codecs
import dataclasses
import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from eagle3kit.data.records import ChatRecord, Message, display_name, open_input
from eagle3kit.errors import InputError, first_line, plural

FORMATS = ("auto", "sharegpt", "perfectblend", "openai", "ultrachat")
SUFFIXES = (".jsonl", ".json", ".parquet")

# ShareGPT's `from` values (and the assistant names of its scraped variants)
_SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "chatgpt": "assistant",
                   "bing": "assistant", "bard": "assistant", "assistant": "assistant",
                   "model": "assistant", "system": "system"}
_OPENAI_ROLES = {"user": "user", "assistant": "assistant", "system": "system",
                 "developer": "system"}
_CHUNK = 8 << 20  # bytes read at a time from a JSON array


class RecordError(InputError):
    """One record is unusable; `--skip-invalid` counts it under `reason` and goes on."""

    def __init__(self, reason: str, detail: str = "", *, where: str = ""):
        super().__init__(f"{reason}{': ' + detail if detail else ''}",
                         path=where or None)
        self.reason = reason


@dataclasses.dataclass(frozen=True)
class SourceSpec:
    """One `SOURCE[:WEIGHT]` argument of `mix`."""

    spec: str
    location: str
    weight: float = 1.0

    @property
    def is_hub(self) -> bool:
        return self.location.startswith("hf:")

    @property
    def name(self) -> str:
        """Short name for reports and the records' `source` field."""
        if self.location == "-":
            return "stdin"
        return self.location if self.is_hub else Path(self.location).name


def parse_source(spec: str) -> SourceSpec:
    """`PATH[:WEIGHT]`, `-[:WEIGHT]` (JSONL on stdin) or `hf:NAME[:CONFIG][@SPLIT][:WEIGHT]`;
    a trailing `:NUMBER` is the weight."""
    location, weight = spec, 1.0
    head, sep, tail = spec.rpartition(":")
    if sep and head and head != "hf":
        try:
            weight = float(tail)
        except ValueError:
            if Path(head).suffix in SUFFIXES and not spec.startswith("hf:"):  # `a.jsonl:0,4`
                raise InputError(f"weight must be a positive number, got {tail!r}",
                                 path=spec) from None
        else:
            location = head
            if not (math.isfinite(weight) and weight > 0):
                raise InputError(f"weight must be a positive number, got {tail!r}", path=spec)
    if location == "-":  # JSONL on stdin
        return SourceSpec(spec, location, weight)
    if location.startswith("hf:"):
        if len(location) <= 3:
            raise InputError("expected hf:NAME[:CONFIG][@SPLIT]", path=spec)
        return SourceSpec(spec, location, weight)
    path = Path(location).expanduser()
    if path.suffix not in SUFFIXES:
        raise InputError("unknown source type: expected a .jsonl, .json or .parquet file or "
                         "hf:NAME[:CONFIG][@SPLIT]", path=location)
    if not path.is_file():
        raise InputError("no such file", path=location)
    return SourceSpec(spec, str(path), weight)


@dataclasses.dataclass
class Raw:
    """One record as read: the decoded value, or why it could not be decoded."""

    where: str  # "file:line", "file: record N (line L)", "hf:name row N"
    number: int  # 1-based record number within the source
    value: Any = None
    error: str | None = None


class Reader:
    """Iterates the raw records of a source; `notes` collects what a human should know
    (such as a cut-off tail that was skipped)."""

    def __init__(self, spec: SourceSpec):
        self.spec = spec
        self.notes: list[str] = []

    def __iter__(self) -> Iterator[Raw]:
        if self.spec.is_hub:
            return self._hub()
        if self.spec.location == "-":
            return self._jsonl()
        return {".jsonl": self._jsonl, ".json": self._json_array,
                ".parquet": self._parquet}[Path(self.spec.location).suffix]()

    def _jsonl(self) -> Iterator[Raw]:
        path = display_name(self.spec.location)
        number = 0
        with open_input(self.spec.location) as f:
            for line_no, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                number += 1
                where = f"{path}:{line_no}"
                try:
                    yield Raw(where, number, json.loads(line.rstrip()))
                except (json.JSONDecodeError, UnicodeDecodeError) as e:
                    yield Raw(where, number, error=_json_why(e, column=True))

    def _json_array(self) -> Iterator[Raw]:
        """Elements of a top-level array, decoded one at a time from a sliding buffer."""
        path = self.spec.location
        decoder, text = json.JSONDecoder(), codecs.getincrementaldecoder("utf-8")()
        buf, i, line, eof, number = "", 0, 1, False, 0
        expect = "["  # then "value" | "," | "]"
        size = Path(path).stat().st_size
        with open(path, "rb") as f:
            while True:
                while i < len(buf) and buf[i] in " \t\r\n":
                    line += buf[i] == "\n"
                    i += 1
                if i >= len(buf) - 1 and not eof:  # refill, keeping the unread part
                    buf, i, eof = buf[i:] + _decode(text, f.read(_CHUNK), path, line), 0, \
                        f.tell() >= size
                    continue
                if i >= len(buf):
                    if expect != "end":
                        raise InputError("empty file" if expect == "[" else
                                         "ends before the closing ']'", path=path)
                    return
                c = buf[i]
                if expect == "[":
                    if c != "[":
                        raise InputError("not a JSON array (a .json source must hold a list "
                                         "of records; use .jsonl for one record per line)",
                                         path=path, line=line)
                    i, expect = i + 1, "value"
                elif expect == "," and c in ",]":
                    i, expect = i + 1, ("value" if c == "," else "end")
                elif expect == "value" and c == "]" and number == 0:
                    i, expect = i + 1, "end"
                elif expect in ("value", ","):
                    if expect == ",":
                        raise InputError(f"expected ',' or ']' after record {number}",
                                         path=path, line=line)
                    try:
                        value, j = decoder.raw_decode(buf, i)
                    except json.JSONDecodeError as e:
                        cut = e.msg.startswith("Unterminated") or e.pos >= len(buf.rstrip())
                        if cut and not eof:
                            buf, i, eof = buf[i:] + _decode(text, f.read(_CHUNK), path, line), \
                                0, f.tell() >= size
                            continue
                        if cut:  # bytes of an incomplete UTF-8 character are still pending
                            tail = len(buf[i:].encode()) + len(text.getstate()[0])
                            self.notes.append(
                                f"{path}: the last {tail:,} bytes (from line {line}) are an "
                                f"incomplete record, skipped; the file looks cut off. "
                                f"{plural(number, 'complete record')} read")
                            return
                        raise InputError(f"record {number + 1}: malformed JSON "
                                         f"({_json_why(e)})", path=path, line=line) from None
                    number += 1
                    yield Raw(f"{path}:{line} (record {number})", number, value)
                    line += buf.count("\n", i, j)
                    i, expect = j, ","
                else:  # trailing content after the closing bracket
                    raise InputError("unexpected data after the closing ']'", path=path,
                                     line=line)

    def _parquet(self) -> Iterator[Raw]:
        import pyarrow.parquet as pq

        path = self.spec.location
        try:
            f = pq.ParquetFile(path)
            number = 0
            for batch in f.iter_batches(batch_size=1024):
                for row in batch.to_pylist():
                    number += 1
                    yield Raw(f"{path}: row {number}", number, row)
        except (OSError, ValueError) as e:  # pyarrow's ArrowInvalid is a ValueError
            raise InputError(f"not a readable parquet file ({first_line(e, type(e).__name__)})",
                             path=path) from None

    def _hub(self) -> Iterator[Raw]:
        name, config, split = parse_hub(self.spec.location)
        try:
            import datasets

            ds = datasets.load_dataset(name, config, split=split, streaming=True)
            for number, row in enumerate(ds, start=1):
                yield Raw(f"{self.spec.location} row {number}", number, row)
        except (ImportError, OSError, ValueError, FileNotFoundError) as e:
            raise InputError(f"cannot load the data set ({first_line(e, type(e).__name__)})",
                             path=self.spec.location) from None
        except Exception as e:  # datasets raises its own (DatasetNotFoundError, ...)
            if type(e).__module__.startswith(("datasets", "huggingface_hub", "requests")):
                raise InputError(f"cannot load the data set ({first_line(e, type(e).__name__)})",
                                 path=self.spec.location) from None
            raise


def parse_hub(location: str) -> tuple[str, str | None, str]:
    """`hf:NAME[:CONFIG][@SPLIT]` -> (name, config, split); the split defaults to train."""
    rest = location[3:]
    rest, _, split = rest.partition("@")
    name, _, config = rest.partition(":")
    return name, config or None, split or "train"


def normalise(raw: Raw, fmt: str, source: str) -> ChatRecord:
    """A `ChatRecord` from one raw record, or a `RecordError` saying why not."""
    value = raw.value
    if raw.error is not None:
        raise RecordError("malformed JSON", raw.error, where=raw.where)
    if not isinstance(value, dict):
        raise RecordError("unknown record shape", f"expected a JSON object, got "
                          f"{type(value).__name__}", where=raw.where)
    kind = fmt if fmt != "auto" else _detect(value, raw.where)
    if kind in ("sharegpt", "perfectblend"):
        turns = _field(value, "conversations", raw.where)
        messages = [_message(t, "from", "value", _SHAREGPT_ROLES, raw.where) for t in turns]
    else:
        turns = _field(value, "messages", raw.where)
        messages = [_message(t, "role", "content", _OPENAI_ROLES, raw.where) for t in turns]
    rid = value.get("id", value.get("prompt_id", value.get("conversation_id")))
    rid = str(rid) if rid not in (None, "") else f"{source}:{raw.number}"
    return ChatRecord(id=rid, source=source, messages=messages)


def drop_reason(record: ChatRecord) -> str | None:
    """Why a well-formed conversation cannot train a draft, or None."""
    if not record.messages:
        return "empty conversation"
    if any(not m.content.strip() for m in record.messages):
        return "empty content"
    if not any(m.role == "assistant" for m in record.messages):
        return "no assistant turn"
    return None


def _detect(value: dict, where: str) -> str:
    if "conversations" in value:
        return "sharegpt"
    if "messages" in value:
        return "openai"
    keys = ", ".join(sorted(value)[:8]) or "none"
    raise RecordError("unknown record shape", f"expected 'conversations' (ShareGPT) or "
                      f"'messages' (OpenAI/UltraChat); keys: {keys}", where=where)


def _field(value: dict, key: str, where: str) -> list:
    turns = value.get(key)
    if not isinstance(turns, list):
        raise RecordError("unknown record shape", f"'{key}' must be a list, got "
                          f"{type(turns).__name__}", where=where)
    return turns


def _message(turn: Any, role_key: str, content_key: str, roles: dict[str, str],
             where: str) -> Message:
    if not isinstance(turn, dict) or role_key not in turn:
        raise RecordError("unknown record shape", f"each turn needs '{role_key}' and "
                          f"'{content_key}'", where=where)
    role = roles.get(str(turn[role_key]).lower())
    if role is None:
        raise RecordError("unknown role", f"{turn[role_key]!r} (known: "
                          f"{', '.join(sorted(roles))})", where=where)
    content = turn.get(content_key)
    if isinstance(content, list):  # OpenAI content parts: keep the text parts, refuse others
        if any(not isinstance(p, dict) or p.get("type") != "text" for p in content):
            raise RecordError("non-text content", "only text content parts are supported",
                              where=where)
        content = "".join(str(p.get("text", "")) for p in content)
    if content is None:
        content = ""
    if not isinstance(content, str):
        raise RecordError("unknown record shape", f"'{content_key}' must be a string",
                          where=where)
    return Message(role=role, content=content)


def _decode(decoder: codecs.IncrementalDecoder, chunk: bytes, path: str, line: int) -> str:
    # never final: a file cut inside a multi-byte character leaves those bytes pending
    try:
        return decoder.decode(chunk)
    except UnicodeDecodeError as e:
        raise InputError(f"invalid UTF-8 after line {line} ({e.reason})", path=path) from None


def _json_why(e: Exception, column: bool = False) -> str:
    """Why a JSON text failed, with the column in the line when `column` (a JSONL line: a cut
    one says where it stops); a record of a .json array gives its own line instead."""
    if not isinstance(e, json.JSONDecodeError):
        return str(e)
    return f"{e.msg}: column {e.pos + 1}" if column else e.msg
