"""Shared CLI plumbing: the stderr console, error handling and common options."""

from __future__ import annotations

import functools
import importlib
import os
import signal
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import typer
import typer.core
from rich.console import Console
from rich.text import Text

from eagle3kit.errors import InputError, ResourceError, UserError, device_out_of_memory

# the exceptions of the click Typer parses with (its own copy since Typer 0.2x, else click's)
click_errors = importlib.import_module(typer.BadParameter.__module__)

# Records go to stdout; everything for humans goes to stderr, so pipes stay clean. Markup and
# emoji codes are off: messages carry user paths and file text (`[x].jsonl`, `FILE:-1:`), which
# must print as given; colour comes only from `styled` (rich Text, never parsed). soft_wrap: a
# log file or CI gets whole lines, not paths split at column 80.
console = Console(stderr=True, highlight=False, markup=False, emoji=False, soft_wrap=True)


def styled(label: str, style: str, rest: str = "") -> Text:
    """`label` in `style`, then `rest` verbatim: `styled("error:", "red", " " + message)`."""
    return Text.assemble((label, style), rest)


def debug_enabled() -> bool:
    return os.environ.get("EAGLE3KIT_DEBUG", "") not in ("", "0")


STOPPED = 75  # EX_TEMPFAIL: stopped at a safe point as asked; resumable


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised where the program is, so it unwinds as Ctrl-C does: every `finally`
    runs (temporary files removed, worker pools stopped), then one line and exit 143."""


def _terminate(signum, frame) -> None:
    raise Terminated


def handle_errors(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Turns `UserError` (and file-system errors) into one red line and a meaningful exit code.

    SIGTERM (a batch scheduler, `kill`, `timeout`) is treated as SIGINT is: the command stops,
    cleans up, says so in one line and exits 143 (128 + 15, as 130 is 128 + SIGINT). Jobs that
    stop at a safe point instead (`train`, `regenerate`: jobs/preempt.py) install their own
    handler for their duration. With `--debug` (or EAGLE3KIT_DEBUG=1) the traceback is kept.
    """
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        previous = signal.signal(signal.SIGTERM, _terminate)
        try:
            return fn(*args, **kwargs)
        except (UserError, FileNotFoundError, IsADirectoryError, NotADirectoryError,
                PermissionError, FileExistsError) as e:
            if debug_enabled():
                raise
            code = getattr(e, "exit_code", 2)
            if code == STOPPED:  # a stop that was asked for (a signal, --time-limit): no error
                console.print(styled(_describe(e), "yellow"))
            else:
                console.print(styled("error:", "red", f" {_describe(e)}"))
            raise typer.Exit(code) from None
        except MemoryError:  # numpy could not allocate (ArrayMemoryError): the host's memory
            if debug_enabled():
                raise
            console.print(styled("error:", "red", " out of host memory; lower the batch or "
                                 "cache sizes (see --help)"))
            raise typer.Exit(4) from None
        except RuntimeError as e:  # XLA's allocator, where no job said which options to lower
            if debug_enabled() or not device_out_of_memory(e):
                raise
            console.print(styled("error:", "red", f" {DEVICE_OOM}"))
            raise typer.Exit(4) from None
        except BrokenPipeError:  # `... | head`: the reader left; not an error
            sys.stderr.close()
            raise typer.Exit(0) from None
        except Terminated:
            console.print(styled("terminated", "yellow"))
            raise typer.Exit(143) from None
        except KeyboardInterrupt:
            console.print(styled("interrupted", "yellow"))
            raise typer.Exit(130) from None
        finally:
            signal.signal(signal.SIGTERM, previous)
    return wrapper


# Several processes on one GPU: JAX preallocates 75% of its memory per process, so the second
# one's start-up (or first allocation) finds none left.
DEVICE_OOM = ("out of device memory (another process may hold it: to run several eagle3kit "
              "processes on one GPU, give each a share, e.g. XLA_PYTHON_CLIENT_MEM_FRACTION=0.3, "
              "or XLA_PYTHON_CLIENT_PREALLOCATE=false)")


def _describe(e: BaseException) -> str:
    if isinstance(e, FileExistsError):
        return f"{e.filename or e.args[0]}: already exists"
    if isinstance(e, OSError) and e.filename:
        return f"{e.filename}: {e.strerror or e}"
    return str(e)


# ---- the command line itself: usage errors in our style, help as wide as the screen --------

HELP_WIDTH = 110  # --help's width with no terminal to measure (a pipe, a log): no 80 columns


class Group(typer.core.TyperGroup):
    """The app's command group (`typer.Typer(cls=Group)`): every usage error of every command
    (a missing argument, an unknown option, a bad choice or number) is one `error:` line and
    a pointer to --help, exit 2, as our own errors are, not Typer's boxed usage panel; and
    --help is not wrapped at 80 columns when there is no terminal to measure."""

    def main(self, *args, **kwargs):
        from typer import rich_utils

        width = rich_utils.MAX_WIDTH  # TERMINAL_WIDTH, if set, wins
        if width is None and not os.environ.get("COLUMNS") and not _terminal():
            rich_utils.MAX_WIDTH = HELP_WIDTH
        try:
            return super().main(*args, **kwargs)
        finally:
            rich_utils.MAX_WIDTH = width

    def make_context(self, info_name, args, parent=None, **extra):  # the group's options
        with _usage_errors(lambda: info_name):
            return super().make_context(info_name, args, parent, **extra)

    def invoke(self, ctx):  # a subcommand's parsing, its callbacks, BadParameter raised inside
        with _usage_errors(lambda: " ".join(filter(None, (ctx.command_path,
                                                          ctx.invoked_subcommand)))):
            return super().invoke(ctx)


def _terminal() -> bool:
    """Whether any standard stream is a terminal (rich measures the first it finds)."""
    for fd in (0, 1, 2):
        try:
            os.get_terminal_size(fd)
            return True
        except OSError:
            pass
    return False


class _usage_errors:
    """A usage error inside: one line and exit 2. `command()`: the command's path, for the
    --help pointer, where the error does not carry it (the parser's own errors)."""

    def __init__(self, command: Callable[[], str | None]):
        self.command = command

    def __enter__(self):
        return self

    def __exit__(self, kind, e, tb):
        if not isinstance(e, click_errors.UsageError) or isinstance(
                e, getattr(click_errors, "NoArgsIsHelpError", ())):  # that one is the help
            return False
        command = e.ctx.command_path if e.ctx is not None else self.command()
        console.print(styled("error:", "red", f" {usage_message(e)} (see {command} --help)"))
        raise typer.Exit(2) from None


# pydantic's words for a bad number (Typer coerces with pydantic), in ours
_NUMBER_ERRORS = {"int_parsing": "not an integer", "int_from_float": "not an integer",
                  "float_parsing": "not a number", "bool_parsing": "not true or false",
                  "greater_than_equal": "must be at least {ge}",
                  "greater_than": "must be greater than {gt}",
                  "less_than_equal": "must be at most {le}", "less_than": "must be below {lt}"}


def usage_message(e) -> str:
    """A usage error as our errors read: `--slots 'x': not an integer`,
    `--dtype 'foo': choose bfloat16, float32`, `missing option --target`."""
    if isinstance(e, click_errors.MissingParameter):
        kind = e.param_type or (e.param.param_type_name if e.param else "parameter")
        return f"missing {kind} {_param_name(e)}".rstrip()
    if isinstance(e, click_errors.BadParameter):
        message = e.message
        cause = e.__cause__
        if cause is not None and hasattr(cause, "errors") and cause.errors():
            first = cause.errors()[0]
            known = _NUMBER_ERRORS.get(first.get("type", ""))
            message = known.format(**first.get("ctx", {})) if known else _lower(message)
            return f"{_param_name(e)} {first.get('input')!r}: {message}"
        return f"{_param_name(e)} {message}" if message.startswith("'") else (
            f"{_param_name(e)}: {message}")
    if isinstance(e, click_errors.NoSuchOption) and e.possibilities:
        return f"{_lower(e.message)}; did you mean {' or '.join(sorted(e.possibilities))}?"
    return _lower(e.format_message()).rstrip(".").replace(". Did you mean", "; did you mean")


def _param_name(e) -> str:
    """The option as users write it (`--dtype`), or the argument (`SOURCE`)."""
    hint = e.param_hint
    if hint is None and e.param is not None:
        opts = [o for o in e.param.opts if o.startswith("--")] or e.param.opts
        hint = (opts[0] if e.param.param_type_name == "option"
                else (e.param.metavar or e.param.name or "").upper())
    if isinstance(hint, (list, tuple)):
        hint = " / ".join(hint)
    return str(hint or "")


def _lower(text: str) -> str:
    """`No such option` -> `no such option`; `SOURCE ...` and `'x' ...` as they are."""
    return text[0].lower() + text[1:] if text[:2].istitle() else text


def require_files(**options: str | os.PathLike | None) -> None:
    """Fail fast: each given input file exists (`-` is stdin), before any slow loading.

    Keyword names are the option names: `require_files(data=path)` reports `--data`.
    """
    for name, path in options.items():
        if path is None or str(path) == "-":
            continue
        p = Path(path)
        if not p.exists():
            raise InputError(f"no such file (--{name.replace('_', '-')})", path=path)
        if p.is_dir():
            raise InputError(f"is a directory, expected a file (--{name.replace('_', '-')})",
                             path=path)


def check_output(path: str | os.PathLike | None, option: str, kind: str = "file",
                 inputs: dict[str, str | os.PathLike | None] | None = None) -> None:
    """Fail fast: an output path can be written, before any work. One check for every command
    that writes; `-` and None (stdout, or not asked for) pass.

    `inputs` (option -> path, e.g. `{"-i": input}`): the files the command reads; an output
    that is one of them (the same file by any name) is refused, as `convert` refuses to write
    over its source: writing it would replace what is being read.

    `kind`: "file" (written atomically), "dir" (a run directory written into) or "replace"
    (a directory written whole, then renamed over the path). Refuses an empty name; `.`, `..`
    or `/` where a file or a replaced directory is named; a file output that is a directory;
    a directory output that is a file; a path below a file; and a directory the user cannot
    create files in (tried with a temporary file, removed at once). Errors name the path as
    given.
    """
    if path is None or str(path) == "-":
        return
    given = str(path)
    if not given.strip():
        raise UserError(f"{option} {given!r}: an empty path; give a file name")
    p = Path(given)
    for name, source in (inputs or {}).items():
        if _same_file(p, source):
            raise UserError(f"is also the input ({name} {source}); {option} would replace it: "
                            f"write to another file", path=given)
    if kind != "dir" and (p.name in ("", ".", "..") or p.resolve() == Path(p.resolve().anchor)):
        raise UserError(f"is an existing directory; {option} needs a new name to write",
                        path=given)
    if kind == "file" and p.is_dir():
        raise UserError(f"is a directory; {option} needs a file name", path=given)
    if kind != "file" and p.exists() and not p.is_dir():
        raise UserError(f"is a file; {option} is a directory", path=given)
    parent = p.parent if kind != "dir" or not p.is_dir() else p
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent  # the nearest existing ancestor must be a writable directory
    if not parent.is_dir():
        raise UserError(f"{parent} is a file, not a directory ({option})", path=given)
    try:
        fd, probe = tempfile.mkstemp(prefix=".eagle3kit-probe.", dir=parent)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise UserError(f"cannot write in {parent} ({e.strerror or e}; {option})",
                        path=given) from None


def _same_file(out: Path, source: str | os.PathLike | None) -> bool:
    """Whether `out` names the input `source` (`-`, None and missing inputs never match)."""
    if source is None or str(source) in ("", "-"):
        return False
    src = Path(source)
    try:
        if out.exists() and src.exists():
            return os.path.samefile(out, src)
    except OSError:
        return False
    return out.resolve() == src.resolve()


PACKED_BYTES_PER_TOKEN = 16  # a packed batch: four int32 arrays [rows, T] (data/packing.py)


def check_host_batch(rows: int, seq_len: int, options: str) -> None:
    """Fail fast: a packed batch is built in host memory before it goes to the devices; one
    whose token arrays alone exceed this machine's memory is refused (exit 4) before anything
    loads, not a numpy MemoryError after the target has. `options`: what sets `rows`."""
    need = rows * seq_len * PACKED_BYTES_PER_TOKEN
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if need > total:
        raise ResourceError(f"{options}: a batch of {rows:,} rows x {seq_len:,} tokens needs "
                            f"{need / 2**30:,.1f} GiB of host memory for its token arrays "
                            f"alone, more than this machine's {total / 2**30:,.1f} GiB; lower "
                            "them")


def no_stdout(path: str | os.PathLike | None, option: str, what: str) -> None:
    """Refuses `-` where the output cannot be streamed (a directory, a run, an image)."""
    if path is not None and str(path) == "-":
        raise UserError(f"{option} -: {what} cannot go to stdout; give a path")


def example(text: str) -> str:
    """The runnable example that ends every command's help; append it to the docstring.

    Indented like a docstring body, so the help is dedented uniformly.
    """
    lines = "\n".join("        " + line for line in text.strip().splitlines())
    return f"\n\n    Example:\n\n    \b\n{lines}\n"
