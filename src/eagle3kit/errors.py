"""User-facing errors.

Library code raises `UserError` for anything a user can fix (a missing file, a malformed line, a
mismatched vocab). The CLI prints its message as one line and exits with `exit_code`; a traceback
appears only with `--debug`. Anything else is a bug and keeps its traceback.
"""

from __future__ import annotations


def first_line(e: BaseException, default: str = "") -> str:
    """The first line of an exception's message (libraries raise pages), else `default`."""
    text = str(e).strip()
    return text.splitlines()[0] if text else default


def plural(n: int, noun: str, nouns: str | None = None) -> str:
    """`1 answer`, `2 answers`, `1,024 tokens`: a count and its noun, as user output says it."""
    return f"{n:,} {noun if n == 1 else nouns or noun + 's'}"


def device_out_of_memory(e: BaseException) -> bool:
    """Whether `e` is XLA's or CUDA's out-of-memory (a runtime error, told by its message)."""
    text = str(e)
    return ("RESOURCE_EXHAUSTED" in text or "OUT_OF_MEMORY" in text
            or "out of memory" in text.lower())


class UserError(Exception):
    """An error caused by input, with a message that says what to do."""

    exit_code = 2

    def __init__(self, message: str, *, path: object | None = None, line: int | None = None):
        where = ""
        if path is not None:
            where = f"{path}:{line}: " if line is not None else f"{path}: "
        super().__init__(where + message)


class InputError(UserError):
    """Malformed or unreadable input data (exit 2)."""


class MismatchError(UserError):
    """Artifacts that do not belong together: tokenizer, data, vocab, target, draft (exit 3)."""

    exit_code = 3


class ResourceError(UserError):
    """The machine cannot do what was asked: out of memory, devices, disk (exit 4)."""

    exit_code = 4


class TrainingDiverged(UserError):
    """The loss went non-finite; the last good checkpoint is kept (exit 5)."""

    exit_code = 5


class TimeLimitReached(UserError):
    """`train --time-limit` elapsed: checkpoint written, run resumable (exit 75, EX_TEMPFAIL)."""

    exit_code = 75
