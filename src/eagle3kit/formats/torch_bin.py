"""Reading `pytorch_model.bin` (torch.save's zip format) without torch and without executing
pickled code, for published drafts that predate safetensors (EAGLE's own releases).

The pickle names only tensor rebuilds, typed storages and an OrderedDict; anything else is
refused. Storages are read from the zip's `data/<key>` entries as raw little-endian bytes.
"""

from __future__ import annotations

import collections
import os
import pickle
import zipfile

import ml_dtypes
import numpy as np

from eagle3kit.errors import InputError

_STORAGES = {
    "FloatStorage": np.float32, "HalfStorage": np.float16, "BFloat16Storage": ml_dtypes.bfloat16,
    "DoubleStorage": np.float64, "LongStorage": np.int64, "IntStorage": np.int32,
    "ShortStorage": np.int16, "CharStorage": np.int8, "ByteStorage": np.uint8,
    "BoolStorage": np.bool_,
}


class _StorageType:
    def __init__(self, name: str):
        self.dtype = np.dtype(_STORAGES[name])


def _rebuild(storage, offset, size, stride, *_):
    itemsize = storage.dtype.itemsize
    view = np.lib.stride_tricks.as_strided(storage[offset:], shape=tuple(size),
                                           strides=tuple(s * itemsize for s in stride))
    return np.array(view)


class _Unpickler(pickle.Unpickler):
    def __init__(self, file, archive: zipfile.ZipFile, prefix: str):
        super().__init__(file)
        self._archive, self._prefix = archive, prefix

    def find_class(self, module, name):
        if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
            return _rebuild
        if module == "torch" and name in _STORAGES:
            return _StorageType(name)
        if (module, name) == ("collections", "OrderedDict"):
            return collections.OrderedDict
        raise pickle.UnpicklingError(f"refusing to unpickle {module}.{name}")

    def persistent_load(self, pid):
        kind, storage_type, key, _location, _numel = pid
        if kind != "storage" or not isinstance(storage_type, _StorageType):
            raise pickle.UnpicklingError(f"unexpected persistent id {pid!r}")
        raw = self._archive.read(f"{self._prefix}/data/{key}")
        return np.frombuffer(raw, dtype=storage_type.dtype.newbyteorder("<"))


def load(path: str | os.PathLike) -> dict[str, np.ndarray]:
    """All tensors of a torch.save'd state dict, as numpy arrays."""
    try:
        with zipfile.ZipFile(path) as archive:
            pkl = [n for n in archive.namelist() if n.endswith("/data.pkl")]
            if len(pkl) != 1:
                raise InputError("not a torch.save zip archive (no data.pkl)", path=path)
            prefix = pkl[0][: -len("/data.pkl")]
            with archive.open(pkl[0]) as f:
                state = _Unpickler(f, archive, prefix).load()
    except zipfile.BadZipFile:
        raise InputError("not a zip archive (legacy torch format before 1.6 is not supported; "
                         "re-save it with safetensors)", path=path) from None
    except (pickle.UnpicklingError, KeyError, ValueError, TypeError) as e:
        raise InputError(f"cannot read the state dict ({e})", path=path) from None
    if not isinstance(state, dict) or not all(isinstance(v, np.ndarray) for v in state.values()):
        raise InputError("the file does not hold a flat state dict of tensors", path=path)
    return dict(state)
