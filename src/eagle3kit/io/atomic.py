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


def _umask() -> int:
    mask = os.umask(0o022)  # the only way to read it is to set it; restore at once
    os.umask(mask)
    return mask


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """Yields a temporary path beside `path`; renames it onto `path` on success, durably.

    The file gets the permissions an ordinary `open` would give (0666 less the umask), not
    mkstemp's 0600: a serving container running as another user must be able to read it.
    """
    path = Path(path)
    with _naming(path):  # an error names the file asked for, not the hidden temporary
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.fchmod(fd, 0o666 & ~_umask())
    os.close(fd)
    tmp = Path(tmp)
    try:
        yield tmp
        _fsync_file(tmp)
        with _naming(path):
            os.replace(tmp, path)
        fsync_dir(path.parent)
    finally:
        tmp.unlink(missing_ok=True)


@contextlib.contextmanager
def _naming(path: Path) -> Iterator[None]:
    """Re-raises an OSError of creating or renaming `path`'s temporary as one about `path`."""
    try:
        yield
    except OSError as e:
        raise type(e)(e.errno, e.strerror, str(path)) from None


@contextlib.contextmanager
def atomic_dir(path: str | os.PathLike, *, force: bool = False) -> Iterator[Path]:
    """Yields a temporary directory beside `path`; moves it onto `path` on success, durably.

    An existing `path` (a directory, or a file) is replaced only when `force` is set; it stays
    untouched on failure. The directory gets 0777 less the umask, not mkdtemp's 0700.
    """
    path = Path(path)
    if path.exists() and not force:
        raise FileExistsError(path)
    with _naming(path):
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent))
    os.chmod(tmp, 0o777 & ~_umask())
    try:
        yield tmp
        for root, _, files in os.walk(tmp):
            for name in files:
                _fsync_file(Path(root) / name)
            fsync_dir(Path(root))
        if path.exists() or path.is_symlink():
            old = path.with_name(f".{path.name}.old")
            _remove(old)
            os.replace(path, old)
            os.replace(tmp, path)
            _remove(old)
        else:
            os.replace(tmp, path)
        fsync_dir(path.parent)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _remove(path: Path) -> None:
    """Removes a file, link or directory tree, if there."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


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
