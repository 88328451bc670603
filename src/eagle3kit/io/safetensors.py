"""safetensors files read by memory map and written atomically, bfloat16 included.

The format is an 8-byte little-endian header length, a JSON header (name -> dtype, shape,
byte offsets; `__metadata__` of str -> str) and the raw tensor bytes. Reading maps the file,
so a loader slices only the part of a tensor that one device needs; the `safetensors`
package's numpy backend cannot represent bfloat16, hence this small module.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Mapping
from pathlib import Path

import ml_dtypes
import numpy as np

from eagle3kit.errors import InputError
from eagle3kit.io.atomic import open_output

_DTYPES = {
    "F64": np.dtype(np.float64), "F32": np.dtype(np.float32), "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16), "I64": np.dtype(np.int64),
    "I32": np.dtype(np.int32), "I16": np.dtype(np.int16), "I8": np.dtype(np.int8),
    "U8": np.dtype(np.uint8), "BOOL": np.dtype(np.bool_),
}
_NAMES = {v: k for k, v in _DTYPES.items()}


class SafetensorsFile:
    """A mapped safetensors file: `names`, `metadata`, and `get(name)` -> read-only ndarray."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        try:
            with open(self.path, "rb") as f:
                (n,) = struct.unpack("<Q", f.read(8))
                if n > 100_000_000:
                    raise ValueError("header too large")
                header = json.loads(f.read(n))
        except FileNotFoundError:
            raise InputError("no such file", path=self.path) from None
        except (struct.error, ValueError, UnicodeDecodeError) as e:
            raise InputError(f"not a safetensors file ({e})", path=self.path) from None
        self.metadata: dict[str, str] = header.pop("__metadata__", None) or {}
        self._header = header
        self._offset = 8 + n
        size = self.path.stat().st_size - self._offset
        self._map = np.memmap(self.path, np.uint8, "r", self._offset, (size,)) if size else None

    @property
    def names(self) -> list[str]:
        return list(self._header)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._header[name]["shape"])

    def get(self, name: str) -> np.ndarray:
        try:
            entry = self._header[name]
        except KeyError:
            raise InputError(f"tensor {name!r} not found", path=self.path) from None
        dtype = _DTYPES.get(entry["dtype"])
        if dtype is None:
            raise InputError(f"tensor {name!r} has unsupported dtype {entry['dtype']}",
                             path=self.path)
        begin, end = entry["data_offsets"]
        shape = tuple(entry["shape"])
        if end - begin != int(np.prod(shape)) * dtype.itemsize or self._map is None:
            raise InputError(f"tensor {name!r}: byte range does not match its shape {shape}",
                             path=self.path)
        return self._map[begin:end].view(dtype).reshape(shape)


def load(path: str | os.PathLike) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """All tensors (copied into memory) and the metadata of one file."""
    f = SafetensorsFile(path)
    return {n: np.array(f.get(n)) for n in f.names}, dict(f.metadata)


def save(path: str | os.PathLike, tensors: Mapping[str, np.ndarray],
         metadata: Mapping[str, str] | None = None) -> None:
    """Writes `tensors` atomically (`-` = stdout), in the order given, with string `metadata`."""
    header: dict[str, object] = {}
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    arrays, offset = [], 0
    for name, value in tensors.items():
        a = np.asarray(value)
        if not a.flags.c_contiguous:  # (np.ascontiguousarray would turn a scalar 1-d)
            a = a.copy(order="C")
        if a.dtype not in _NAMES:
            raise TypeError(f"{name}: dtype {a.dtype} cannot be stored in safetensors")
        header[name] = {"dtype": _NAMES[a.dtype], "shape": list(a.shape),
                        "data_offsets": [offset, offset + a.nbytes]}
        arrays.append(a)
        offset += a.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open_output(path, "wb") as f:  # `-`: streamed to stdout (a pipe or a file)
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for a in arrays:
            f.write(a.tobytes())


def checkpoint_files(directory: str | os.PathLike) -> list[Path]:
    """The safetensors files of a checkpoint directory: those its
    model.safetensors.index.json names (sharded), else every *.safetensors in it."""
    directory = Path(directory)
    index = directory / "model.safetensors.index.json"
    if not index.is_file():
        return sorted(directory.glob("*.safetensors"))
    try:
        weight_map = json.loads(index.read_text()).get("weight_map")
    except (json.JSONDecodeError, AttributeError) as e:
        raise InputError(f"invalid safetensors index ({e})", path=index) from None
    if not isinstance(weight_map, dict):
        raise InputError("safetensors index without a weight_map", path=index)
    return [directory / f for f in sorted(set(weight_map.values()))]
