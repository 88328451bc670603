"""Shared CLI plumbing: the stderr console, error handling and common options."""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import Callable
from typing import Any

import typer
from rich.console import Console

from eagle3kit.errors import UserError

# Records go to stdout; everything for humans goes to stderr, so pipes stay clean.
console = Console(stderr=True, highlight=False)


def debug_enabled() -> bool:
    return os.environ.get("EAGLE3KIT_DEBUG", "") not in ("", "0")


def handle_errors(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Turns `UserError` (and file-system errors) into one red line and a meaningful exit code.

    With `--debug` (or EAGLE3KIT_DEBUG=1) the traceback is kept.
    """
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except (UserError, FileNotFoundError, IsADirectoryError, PermissionError,
                FileExistsError) as e:
            if debug_enabled():
                raise
            console.print(f"[red]error:[/red] {_describe(e)}", soft_wrap=True)
            raise typer.Exit(getattr(e, "exit_code", 2)) from None
        except BrokenPipeError:  # `... | head`: the reader left; not an error
            sys.stderr.close()
            raise typer.Exit(0) from None
        except KeyboardInterrupt:
            console.print("[yellow]interrupted[/yellow]")
            raise typer.Exit(130) from None
    return wrapper


def _describe(e: BaseException) -> str:
    if isinstance(e, FileExistsError):
        return f"{e.filename or e.args[0]}: already exists (pass --force to replace it)"
    if isinstance(e, OSError) and e.filename:
        return f"{e.filename}: {e.strerror or e}"
    return str(e)


def example(text: str) -> str:
    """The runnable example that ends every command's help; append it to the docstring.

    Indented like a docstring body, so the help is dedented uniformly.
    """
    lines = "\n".join("        " + line for line in text.strip().splitlines())
    return f"\n\n    Example:\n\n    \b\n{lines}\n"
