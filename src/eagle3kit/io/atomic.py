"""Atomic outputs: a reader never sees a half-written file or directory.

Everything eagle3kit writes goes to a temporary sibling first and is renamed into place only
when complete, so a crash, a kill or a bad input record leaves the previous state intact.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import IO


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """Yields a temporary path beside `path`; renames it onto `path` on success."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    tmp = Path(tmp)
    try:
        yield tmp
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


@contextlib.contextmanager
def atomic_dir(path: str | os.PathLike, *, force: bool = False) -> Iterator[Path]:
    """Yields a temporary directory beside `path`; moves it onto `path` on success.

    An existing `path` is replaced only when `force` is set; it stays untouched on failure.
    """
    path = Path(path)
    if path.exists() and not force:
        raise FileExistsError(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent))
    try:
        yield tmp
        if path.exists():
            old = path.with_name(f".{path.name}.old")
            shutil.rmtree(old, ignore_errors=True)
            os.replace(path, old)
            os.replace(tmp, path)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


@contextlib.contextmanager
def open_output(path: str | os.PathLike | None, mode: str = "w") -> Iterator[IO]:
    """Opens `path` for writing atomically; `-` or None means stdout (written as it goes)."""
    if path is None or str(path) == "-":
        stream = sys.stdout.buffer if "b" in mode else sys.stdout
        yield stream
        stream.flush()
        return
    with atomic_path(path) as tmp, open(tmp, mode) as f:
        yield f


def fsync_dir(path: Path) -> None:
    """Makes a rename inside `path` durable."""
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
