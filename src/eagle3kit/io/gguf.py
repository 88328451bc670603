"""GGUF checkpoints: config from the header, tensors dequantised to float32 with HF names.

The header is read here (GGUFHeader), the tensors dequantised by the `gguf` package (no
torch): its `dequantize` reads every type it knows (F32, F16, BF16, Q4_0..Q8_0, the K-quants
Q2_K..Q6_K, ...), so a tensor here is exactly the package's. Two llama.cpp conventions are undone, as transformers does, so a GGUF and a
safetensors copy of one model give the same weights: Llama-family Q and K projections are
stored with the rotary halves interleaved (permuted back here), and Gemma's norms are stored
as `1 + w` (the HF weight is `w`; its RMSNorm multiplies by `1 + w`).

A family (core/families) says which GGUF architecture it is, which of those conventions it
carries, its own tensor names and the config.json fields its header lacks (Gemma-3's).
"""

from __future__ import annotations

import functools
import math
import mmap
import os
import re
import struct
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from eagle3kit.core import families
from eagle3kit.errors import InputError

# GGUF tensor name -> HF tensor name
_NAMES = [
    (r"token_embd\.weight", "model.embed_tokens.weight"),
    (r"output_norm\.weight", "model.norm.weight"),
    (r"output\.weight", "lm_head.weight"),
    (r"blk\.(\d+)\.attn_norm\.weight", r"model.layers.\1.input_layernorm.weight"),
    (r"blk\.(\d+)\.ffn_norm\.weight", r"model.layers.\1.post_attention_layernorm.weight"),
    (r"blk\.(\d+)\.attn_q\.(weight|bias)", r"model.layers.\1.self_attn.q_proj.\2"),
    (r"blk\.(\d+)\.attn_k\.(weight|bias)", r"model.layers.\1.self_attn.k_proj.\2"),
    (r"blk\.(\d+)\.attn_v\.(weight|bias)", r"model.layers.\1.self_attn.v_proj.\2"),
    (r"blk\.(\d+)\.attn_output\.weight", r"model.layers.\1.self_attn.o_proj.weight"),
    (r"blk\.(\d+)\.attn_q_norm\.weight", r"model.layers.\1.self_attn.q_norm.weight"),
    (r"blk\.(\d+)\.attn_k_norm\.weight", r"model.layers.\1.self_attn.k_norm.weight"),
    (r"blk\.(\d+)\.ffn_gate\.weight", r"model.layers.\1.mlp.gate_proj.weight"),
    (r"blk\.(\d+)\.ffn_up\.weight", r"model.layers.\1.mlp.up_proj.weight"),
    (r"blk\.(\d+)\.ffn_down\.weight", r"model.layers.\1.mlp.down_proj.weight"),
]


def _hf_name(name: str, family: families.registry.Family | None = None) -> str | None:
    """The HF name of GGUF tensor `name`: the family's own names first, then `_NAMES`."""
    for pattern, repl in (family.gguf_names if family else []) + _NAMES:
        if re.fullmatch(pattern, name):
            return re.sub(pattern, repl, name)
    return None


def _field(reader: GGUFHeader, key: str, default: Any = None) -> Any:
    return reader.fields.get(key, default)


def open_reader(path: str | os.PathLike) -> GGUFHeader:
    """The header of the GGUF file `path`, shared in a process: a command reads it for the
    tokenizer and again for the weights."""
    p = Path(path).resolve()
    stat = p.stat()
    return _reader(p, stat.st_mtime_ns, stat.st_size)


@functools.lru_cache(maxsize=2)
def _reader(path: Path, mtime_ns: int, size: int) -> GGUFHeader:
    return GGUFHeader(path)


class GGUFTensor(NamedTuple):
    """One tensor's entry in the header: `dims` in GGUF order (fastest first), `data` a view
    of the file laid out as the `gguf` package's reader lays it out (what `dequantize` takes:
    the elements for plain types, bytes per row for quantised ones)."""

    name: str
    tensor_type: int
    dims: tuple[int, ...]
    data: np.ndarray


# GGUF value types: 0-7 and 10-12 scalars (struct format), 8 a string, 9 an array
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q",
            12: "d"}
_STRING, _ARRAY = 8, 9
_NUMPY = {0: "u1", 1: "i1", 2: "u2", 3: "i2", 4: "u4", 5: "i4", 6: "f4", 7: "?", 10: "u8",
          11: "i8", 12: "f8"}
# plain (unquantised) tensor types and their element dtypes; the rest are bytes
_PLAIN = {0: "f4", 1: "f2", 24: "i1", 25: "i2", 26: "i4", 27: "i8", 28: "f8"}


class GGUFHeader:
    """A GGUF file's key/values (`fields`: key -> Python value, arrays as lists) and tensor
    entries (`tensors`), the tensor data mapped, not read.

    Read here rather than by the `gguf` package's `GGUFReader`, which makes numpy views of
    every part of every value: Gemma-3's 262,144-token vocabulary took it 11-17 s a read (each
    `tokenize`, `train`, `eval` and `regenerate` command reads one); numeric arrays come in
    one `np.frombuffer` here and strings in one pass, well under a second.
    """

    def __init__(self, path: Path):
        with open(path, "rb") as f:
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        buf = self._map
        if buf[:4] != b"GGUF":
            raise ValueError("GGUF magic invalid")
        self._order = "<"
        self.byte_order = "<"
        (version,) = struct.unpack_from("<I", buf, 4)
        if version & 0xFFFF == 0:  # written on a big-endian machine
            self._order = self.byte_order = ">"
            (version,) = struct.unpack_from(">I", buf, 4)
        if version not in (2, 3):
            raise ValueError(f"GGUF version {version} (supported: 2, 3)")
        n_tensors, n_fields = self._unpack("QQ", 8)
        self._offset = 24
        self.fields: dict[str, Any] = {}
        for _ in range(n_fields):
            key = self._string()
            if key in self.fields:
                raise ValueError(f"duplicate key {key!r}")
            self.fields[key] = self._value(self._unpack1("I"))
        infos = []
        for _ in range(n_tensors):
            name = self._string()
            dims = self._unpack("Q" * self._unpack1("I"))
            infos.append((name, self._unpack1("I"), dims, self._unpack1("Q")))
        align = self.fields.get("general.alignment", 32)
        if not isinstance(align, int) or align <= 0 or align & (align - 1):
            raise ValueError(f"bad general.alignment {align!r}")
        start = -(-self._offset // align) * align
        self.tensors = [self._tensor(start, *info) for info in infos]
        if len({t.name for t in self.tensors}) != len(self.tensors):
            raise ValueError("duplicate tensor names")

    def _unpack(self, fmt: str, offset: int | None = None) -> tuple:
        fmt = self._order + fmt
        if offset is not None:
            return struct.unpack_from(fmt, self._map, offset)
        values = struct.unpack_from(fmt, self._map, self._offset)
        self._offset += struct.calcsize(fmt)
        return values

    def _unpack1(self, fmt: str) -> Any:
        return self._unpack(fmt)[0]

    def _string(self) -> str:
        n = self._unpack1("Q")
        end = self._offset + n
        if end > len(self._map):
            raise ValueError("truncated string")
        text = self._map[self._offset:end].decode("utf-8")
        self._offset = end
        return text

    def _value(self, kind: int) -> Any:
        if kind in _SCALARS:
            return self._unpack1(_SCALARS[kind])
        if kind == _STRING:
            return self._string()
        if kind != _ARRAY:
            raise ValueError(f"unknown GGUF value type {kind}")
        item, n = self._unpack("IQ")
        if item in _NUMPY:
            dtype = np.dtype(_NUMPY[item]).newbyteorder(self._order)
            values = np.frombuffer(self._map, dtype, n, self._offset)
            self._offset += values.nbytes
            return values.tolist()
        if item == _STRING:  # the vocabulary: one pass, no struct call per token
            return self._strings(n)
        return [self._value(item) for _ in range(n)]

    def _strings(self, n: int) -> list[str]:
        buf, offset, out = self._map, self._offset, []
        size = "little" if self._order == "<" else "big"
        for _ in range(n):
            length = int.from_bytes(buf[offset:offset + 8], size)
            offset += 8
            out.append(buf[offset:offset + length].decode("utf-8"))
            offset += length
        if offset > len(buf):
            raise ValueError("truncated string array")
        self._offset = offset
        return out

    def _tensor(self, start: int, name: str, kind: int, dims: tuple, offset: int) -> GGUFTensor:
        from gguf import GGMLQuantizationType
        from gguf.quants import quant_shape_to_byte_shape

        shape = tuple(reversed(dims))
        if kind in _PLAIN:
            dtype = np.dtype(_PLAIN[kind]).newbyteorder(self._order)
        else:
            dtype = np.dtype(np.uint8)
            shape = quant_shape_to_byte_shape(shape, GGMLQuantizationType(kind))
        count = math.prod(shape)
        data = np.frombuffer(self._map, dtype, count, start + offset).reshape(shape)
        return GGUFTensor(name, kind, dims, data)


class GGUFCheckpoint:
    """A GGUF model file: `config` (HF-style dict) and `get(hf_name)` -> float32 ndarray."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        if not self.path.is_file():
            raise InputError("no such GGUF file", path=self.path)
        try:
            self.reader = open_reader(self.path)
        except Exception as e:  # gguf raises ValueError/struct errors on a bad file
            raise InputError(f"not a readable GGUF file ({e})", path=self.path) from None
        arch = _field(self.reader, "general.architecture")
        family = families.by_gguf_arch(arch)
        if family is None:
            raise InputError(f"unsupported GGUF architecture {arch!r}; supported: "
                             + ", ".join(families.registry.gguf_archs()), path=self.path)
        self.arch, self.family = arch, family
        self._tensors = {}
        for t in self.reader.tensors:
            hf = _hf_name(t.name, family)
            if hf is None:
                if t.name == "rope_freqs.weight":
                    raise InputError("GGUF with baked rope_freqs (Llama-3.1 rope scaling) is not "
                                     "supported; load the HF safetensors checkpoint instead",
                                     path=self.path)
                raise InputError(f"unexpected tensor {t.name!r}", path=self.path)
            self._tensors[hf] = t
        self.config = self._config()

    def _config(self) -> dict[str, Any]:
        a = self.arch

        def get(key, default=None):
            return _field(self.reader, f"{a}.{key}", default)

        hidden, heads = int(get("embedding_length")), int(get("attention.head_count"))
        embed = self._tensors["model.embed_tokens.weight"]
        vocab = int(get("vocab_size", embed.dims[-1]))
        head_dim = int(get("attention.key_length", hidden // heads))
        cfg: dict[str, Any] = {
            "architectures": [self.family.model_types[self.family.gguf_model_type]],
            "model_type": self.family.gguf_model_type,
            "vocab_size": vocab,
            "hidden_size": hidden,
            "intermediate_size": int(get("feed_forward_length")),
            "num_hidden_layers": int(get("block_count")),
            "num_attention_heads": heads,
            "num_key_value_heads": int(get("attention.head_count_kv", heads)),
            "head_dim": head_dim,
            "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon", 1e-6)),
            "rope_theta": float(get("rope.freq_base", 10000.0)),
            "max_position_embeddings": int(get("context_length", 8192)),
            "tie_word_embeddings": "lm_head.weight" not in self._tensors,
            "bos_token_id": _field(self.reader, "tokenizer.ggml.bos_token_id"),
            "eos_token_id": _field(self.reader, "tokenizer.ggml.eos_token_id"),
            "_name_or_path": str(self.path),
        }
        scaling = get("rope.scaling.type")
        if self.family.gguf_config is not None:
            cfg.update(self.family.gguf_config(get, scaling, self.path))
        elif scaling not in (None, "none"):
            raise InputError(f"GGUF rope scaling {scaling!r} is not supported", path=self.path)
        return cfg

    @property
    def names(self) -> list[str]:
        return list(self._tensors)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(reversed(self._tensors[name].dims))

    def get(self, name: str) -> np.ndarray:
        from gguf import GGMLQuantizationType

        t = self._tensors[name]
        qtype = GGMLQuantizationType(t.tensor_type)
        try:
            w = _dequantize(t.data, qtype)
        except (NotImplementedError, ValueError) as e:
            raise InputError(f"tensor {t.name!r} has unsupported GGUF type {qtype.name} ({e})",
                             path=self.path) from None
        w = np.asarray(w, np.float32).reshape(self.shape(name))
        fix = self._fix(name)
        if fix == ("minus_one",):
            w = w - np.float32(1)  # stored as 1 + w (see the module docstring)
        elif fix:
            from eagle3kit.io import gguf_quants

            w = gguf_quants.unpermute_rotary(w, fix[1])
        return w

    # ---- on the device: only the stored bytes are transferred (io/gguf_quants.py) ----------
    # io.gguf_quants (JAX) is imported where it is used: reading a file's metadata, as
    # `tokenize` does, must not import JAX, or its worker processes are spawned (each loading
    # the tokenizer again) instead of forked (sharing the parent's)

    def on_device(self) -> bool:
        """Whether every tensor can be dequantised on the device: a little-endian file of the
        types io.gguf_quants reads; else the loader takes `get` (the `gguf` package)."""
        from eagle3kit.io import gguf_quants

        return self.reader.byte_order == "<" and all(
            gguf_quants.supported(t.tensor_type) for t in self._tensors.values())

    def _fix(self, name: str) -> tuple:
        """What `get` does after dequantising `name`, as a hashable description."""
        if self.family.gguf_norms_plus_one and name.endswith("norm.weight"):
            return ("minus_one",)
        if self.family.gguf_rotary_permuted and name.endswith(("q_proj.weight", "k_proj.weight")):
            key = "num_key_value_heads" if name.endswith("k_proj.weight") else \
                "num_attention_heads"
            return ("rotary", self.config[key])
        return ()

    def load_weights(self, plans: list[tuple]) -> list:
        """The loader's weights, one per plan (names, transform, cfg, dtype, sharding,
        stacked): the tensors `names` (one per layer when stacked) dequantised, fixed as `get`
        fixes them, transformed, stacked and cast in one program on one device of `sharding`,
        then sent to `sharding`. The programs are compiled in threads first (XLA compiles
        outside the GIL), then run one at a time, so one weight's intermediates are on the
        device at once."""
        import jax

        from eagle3kit.io import gguf_quants

        jobs = []
        for names, transform, cfg, dtype, sharding, stacked in plans:
            flat = [group[0] for group in names]
            specs = tuple((self._tensors[n].tensor_type, self.shape(n), self._fix(n))
                          for n in flat)
            batches = [[self._tensors[flat[i]].data for i in layers]
                       for layers in gguf_quants.alike(specs).values()]
            shapes = tuple(jax.ShapeDtypeStruct((len(b), *b[0].shape), b[0].dtype)
                           for b in batches)
            jobs.append(((specs, transform, cfg, np.dtype(dtype), stacked, sharding, shapes),
                         batches))
        with ThreadPoolExecutor(min(len(jobs), os.cpu_count() or 1) or 1) as pool:
            programs = list(pool.map(lambda job: gguf_quants.compiled(*job[0]), jobs))
        # one copy of the quantised bytes on the host (a fraction of the weight's size)
        return [jax.device_put(program(*(np.stack(b) for b in batches)), job[5])
                for program, (job, batches) in zip(programs, jobs, strict=True)]

    def device_tensor(self, name: str):
        """`get(name)` computed on the default device (float32, equal to `get`)."""
        from eagle3kit.io import gguf_quants

        spec = (self._tensors[name].tensor_type, self.shape(name), self._fix(name))
        return gguf_quants.tensor_program(spec)(self._tensors[name].data)


# values the `gguf` package dequantises per call of its block code (16 rows of this many)
_ROW_VALUES = 1 << 16


def _dequantize(data: np.ndarray, qtype: Any) -> np.ndarray:
    """The `gguf` package's dequantisation of a tensor's `data`, with its rows joined first.

    The package runs its block code over 16 rows at a time, some ten numpy calls for each
    group: for Gemma-3's 262,144-row embedding (Q8_0) that took 2 s of a 2.5 s load. A
    block never spans two rows, so rows joined into rows of about 65,536 values (whole rows
    of blocks; a tensor's block count decides how many) give the same values, in 0.4 s.
    """
    from gguf.constants import GGML_QUANT_SIZES
    from gguf.quants import dequantize

    if data.dtype != np.uint8:  # a plain type, as the file stores it
        return dequantize(data, qtype)
    block_values, block_bytes = GGML_QUANT_SIZES[qtype]
    blocks = data.size // block_bytes
    per_row = math.gcd(blocks, max(1, _ROW_VALUES // block_values))
    return dequantize(data.reshape(blocks // per_row, per_row * block_bytes), qtype)
