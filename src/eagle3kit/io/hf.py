"""Target checkpoints: local HF directories, Hub ids and GGUF files, loaded into shardings.

`resolve_target(spec)` accepts a directory with `config.json` and safetensors (single file or
sharded with an index), a `.gguf` file, or a Hub id (downloaded through huggingface_hub into
its cache, then read exactly like a local directory). `load_target` builds every weight with
`jax.make_array_from_callback`: each device receives only its own slice, read from the
memory-mapped file, so an 8B target never needs a full host copy per device.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from eagle3kit.core import families
from eagle3kit.core.config import TargetConfig
from eagle3kit.core.sharding import ArrayInfo, is_info, shardings
from eagle3kit.core.target import TargetWeights
from eagle3kit.errors import InputError
from eagle3kit.io.gguf import GGUFCheckpoint
from eagle3kit.io.hub import is_hub_id, snapshot
from eagle3kit.io.mxfp4 import Mxfp4Source
from eagle3kit.io.safetensors import SafetensorsFile, checkpoint_files


class SafetensorsCheckpoint:
    """A HF model directory: `config` and `get(name)` over one or many safetensors files."""

    def __init__(self, directory: Path):
        self.path = directory
        self.config = read_config(directory)
        files = checkpoint_files(directory)  # sharded (index) or not
        if not files:
            found = ", ".join(sorted(p.name for p in directory.iterdir())[:8])
            raise InputError("no *.safetensors weights (only safetensors and GGUF are "
                             f"supported; found: {found})", path=directory)
        self._where = {}
        for p in files:
            f = SafetensorsFile(p)
            self._where.update({n: f for n in f.names})

    @property
    def names(self) -> list[str]:
        return list(self._where)

    def shape(self, name: str) -> tuple[int, ...]:
        return self._where[name].shape(name)

    def get(self, name: str) -> np.ndarray:
        return self._where[name].get(name)


@dataclasses.dataclass
class TargetCheckpoint:
    """A resolved target: its config, where it came from, and a tensor source."""

    config: TargetConfig
    source: Any  # SafetensorsCheckpoint | GGUFCheckpoint
    path: Path
    name: str

    @property
    def hf_config(self) -> dict[str, Any]:
        return self.source.config


def read_config(directory: Path) -> dict[str, Any]:
    """A checkpoint directory's config.json."""
    path = directory / "config.json"
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise InputError("no config.json in the checkpoint directory", path=directory) from None
    except json.JSONDecodeError as e:
        raise InputError(f"invalid JSON ({e})", path=path) from None


def _locate(spec: str) -> str:
    """What a target spec names: "dir", "gguf" or "hub"; anything else is an InputError."""
    path = Path(spec).expanduser()
    if path.is_dir():
        return "dir"
    if path.is_file() and path.suffix == ".gguf":
        return "gguf"
    if path.is_file():
        raise InputError("unsupported checkpoint file (expected a .gguf file or a directory "
                         "with config.json and safetensors)", path=path)
    if is_hub_id(spec):
        return "hub"
    raise InputError("no such checkpoint: not a directory, .gguf file or Hub id", path=spec)


def resolve_target(spec: str | os.PathLike) -> TargetCheckpoint:
    """Opens a target from a local directory, a `.gguf` file or a Hub id."""
    spec = str(spec)
    path = Path(spec).expanduser()
    kind = _locate(spec)
    if kind == "dir":
        source = SafetensorsCheckpoint(path)
    elif kind == "gguf":
        source = GGUFCheckpoint(path)
    else:
        source = SafetensorsCheckpoint(snapshot(
            spec, ["*.json", "*.safetensors", "tokenizer*", "*.jinja"], "the target"))
    cfg = TargetConfig.from_hf_config(source.config, name=spec,
                                      source=getattr(source, "path", spec))
    return TargetCheckpoint(cfg, source, path, spec)


def target_hf_config(spec: str) -> tuple[str, dict[str, Any]]:
    """(name, HF config) of a target, without opening its weights: from the Hub only
    config.json is fetched (what `convert` needs to write engine configs)."""
    kind = _locate(spec)
    if kind == "gguf":
        return spec, GGUFCheckpoint(Path(spec).expanduser()).config
    if kind == "dir":
        return spec, read_config(Path(spec).expanduser())
    try:
        directory = snapshot(spec, ["config.json"], "the target's config.json")
    except InputError as e:
        raise InputError(f"{e}; pass --target with a local directory or .gguf file") from None
    return spec, read_config(directory)


# ---- the key table ----------------------------------------------------------------------------
# pytree path -> (HF name, transform of one HF tensor into eagle3kit's (in, out) layout).
# `{i}` marks a stacked per-layer weight.


def _lin(*split: str) -> Callable[[np.ndarray, TargetConfig], np.ndarray]:
    """HF Linear [out, in] -> [in, *out split]; e.g. q_proj -> [D, N, H]."""
    def f(w, c):
        dims = {"N": c.num_heads, "K": c.num_kv_heads, "H": c.head_dim}
        wt = w.T
        return wt.reshape(wt.shape[0], *(dims[s] for s in split)) if split else wt
    return f


def _heads_in(w, c):  # o_proj [D, N*H] -> [N, H, D]
    return w.T.reshape(c.num_heads, c.head_dim, w.shape[0])


def _bias(heads: str):
    return lambda w, c: w.reshape(c.num_heads if heads == "N" else c.num_kv_heads, c.head_dim)


def _same(w, c):
    return w


def _router(w, c):  # [E, D] -> [D, E]
    return w.T


def _experts(w, c):  # per-expert Linear [E, out, in] -> [E, in, out]
    return np.swapaxes(w, 1, 2)


def _interleaved(start: int):  # gpt-oss gate_up [E, D, 2F], gate and up interleaved
    return lambda w, c: w[..., start::2]


KEY_TABLE: dict[str, tuple[str, Callable]] = {
    "embed": ("model.embed_tokens.weight", _same),
    "final_norm": ("model.norm.weight", _same),
    "lm_head": ("lm_head.weight", _lin()),
    "layers.attn_norm": ("model.layers.{i}.input_layernorm.weight", _same),
    "layers.mlp_norm": ("model.layers.{i}.post_attention_layernorm.weight", _same),
    "layers.q": ("model.layers.{i}.self_attn.q_proj.weight", _lin("N", "H")),
    "layers.k": ("model.layers.{i}.self_attn.k_proj.weight", _lin("K", "H")),
    "layers.v": ("model.layers.{i}.self_attn.v_proj.weight", _lin("K", "H")),
    "layers.o": ("model.layers.{i}.self_attn.o_proj.weight", _heads_in),
    "layers.q_bias": ("model.layers.{i}.self_attn.q_proj.bias", _bias("N")),
    "layers.k_bias": ("model.layers.{i}.self_attn.k_proj.bias", _bias("K")),
    "layers.v_bias": ("model.layers.{i}.self_attn.v_proj.bias", _bias("K")),
    "layers.q_norm": ("model.layers.{i}.self_attn.q_norm.weight", _same),
    "layers.k_norm": ("model.layers.{i}.self_attn.k_norm.weight", _same),
    "layers.o_bias": ("model.layers.{i}.self_attn.o_proj.bias", _same),
    "layers.sinks": ("model.layers.{i}.self_attn.sinks", _same),
    "mlp.gate": ("model.layers.{i}.mlp.gate_proj.weight", _lin()),
    "mlp.up": ("model.layers.{i}.mlp.up_proj.weight", _lin()),
    "mlp.down": ("model.layers.{i}.mlp.down_proj.weight", _lin()),
    # Qwen3-MoE: one Linear per expert ({j}), stacked on load
    "experts.router": ("model.layers.{i}.mlp.gate.weight", _router),
    "experts.gate": ("model.layers.{i}.mlp.experts.{j}.gate_proj.weight", _experts),
    "experts.up": ("model.layers.{i}.mlp.experts.{j}.up_proj.weight", _experts),
    "experts.down": ("model.layers.{i}.mlp.experts.{j}.down_proj.weight", _experts),
}
# The transforms a family's `HF_KEYS` name (core/families): where its weights differ from
# the table above.
TRANSFORMS: dict[str, Callable] = {"same": _same, "router": _router,
                                   "even": _interleaved(0), "odd": _interleaved(1)}


def key_table(cfg: TargetConfig) -> dict[str, tuple[str, Callable]]:
    """KEY_TABLE with the family's own names (`HF_KEYS`) in place."""
    own = {path: (name, TRANSFORMS[transform])
           for path, (name, transform) in families.get(cfg.family).hf_keys.items()}
    return {**KEY_TABLE, **own}


def _layer_ids(cfg: TargetConfig, key: str) -> list[int]:
    """The HF layer indices a stacked weight covers: every layer, the dense or the sparse."""
    sparse = cfg.moe.sparse_layers if cfg.moe else (False,) * cfg.num_layers
    if key.startswith("mlp."):
        return [i for i, s in enumerate(sparse) if not s]
    if key.startswith("experts."):
        return [i for i, s in enumerate(sparse) if s]
    return list(range(cfg.num_layers))


# present in some checkpoints, never used
_IGNORED = re.compile(r".*rotary_emb\.inv_freq$")


def _path_str(path) -> str:
    return ".".join(str(getattr(k, "name", getattr(k, "key", k))) for k in path)


def load_target(ckpt: TargetCheckpoint, mesh: Mesh, dtype: Any = jnp.bfloat16) -> TargetWeights:
    """Loads every weight of `ckpt` straight into its sharding on `mesh`, cast to `dtype`.

    Every name and shape is checked before any device work. A weight may be stacked from
    many tensors: one per layer (`{i}`) and, for Qwen3-MoE, one per expert (`{j}`).
    """
    cfg = ckpt.config
    mxfp4 = "mxfp4" in families.get(cfg.family).quantisations
    src = Mxfp4Source(ckpt.source, ckpt.path) if mxfp4 else ckpt.source
    abstract = TargetWeights.abstract(cfg, dtype)
    shards = shardings(abstract, mesh)
    leaves, treedef = jax.tree_util.tree_flatten_with_path(abstract, is_leaf=is_info)
    shard_leaves = jax.tree_util.tree_leaves(shards)
    table = key_table(cfg)
    available = set(src.names)
    used: set[str] = set()
    plans = []
    for (path, info), sharding in zip(leaves, shard_leaves, strict=True):
        key = _path_str(path)
        pattern, transform = table[key]
        stacked = "{i}" in pattern
        layers = _layer_ids(cfg, key) if stacked else [None]
        experts = range(cfg.moe.num_experts) if "{j}" in pattern else [None]
        names = [[pattern.format(i=i, j=j) for j in experts] for i in layers]
        missing = [n for group in names for n in group if n not in available]
        if missing:
            raise InputError(f"weight {missing[0]!r} is missing (config says "
                             f"{cfg.model_type}, {cfg.num_layers} layers)", path=ckpt.path)
        used.update(n for group in names for n in group)
        plans.append((names, transform, info, sharding, stacked, "{j}" in pattern))
    extra = sorted(n for n in available - used
                   if not _IGNORED.match(n) and not (n == "lm_head.weight"
                                                     and cfg.tie_word_embeddings))
    if extra:
        raise InputError(f"{len(extra)} tensors do not belong to a {cfg.model_type} model with "
                         f"this config, e.g. {extra[0]!r}", path=ckpt.path)
    for names, transform, info, _, stacked, per_expert in plans:
        _check_shapes(src, names, transform, cfg, info, stacked, per_expert, ckpt.path)
    if getattr(src, "on_device", lambda: False)():
        # a GGUF: its stored bytes go to the devices, dequantised and laid out there
        out = src.load_weights([(names, transform, cfg, info.dtype, sharding, stacked)
                                for names, transform, info, sharding, stacked, _ in plans])
    else:
        out = [_load_one(src, names, transform, cfg, info, sharding, stacked, per_expert,
                         ckpt.path)
               for names, transform, info, sharding, stacked, per_expert in plans]
    return jax.tree_util.tree_unflatten(treedef, out)


def _check_shapes(src, names, transform, cfg, info: ArrayInfo, stacked: bool, per_expert: bool,
                  where) -> None:
    """Fails on a shape that does not fit the config, before any device work."""
    expected = info.shape[1:] if stacked else info.shape
    for group in names:
        probes = [np.broadcast_to(np.float32(0), src.shape(n)) for n in group]  # views
        probe = np.stack(probes) if per_expert else probes[0]
        if tuple(transform(probe, cfg).shape) != tuple(expected):
            shown = f"{len(group)} x {tuple(src.shape(group[0]))}" if per_expert else \
                tuple(src.shape(group[0]))
            raise InputError(f"{group[0]}: shape {shown} does not match the config "
                             f"(expected {expected} after transposing)", path=where)


def _load_one(src, names, transform, cfg, info: ArrayInfo, sharding, stacked: bool,
              per_expert: bool, where):
    cache: dict[int, np.ndarray] = {}

    def tensor(g: int) -> np.ndarray:
        # GGUF and MXFP4 tensors are dequantised whole; keep each while this weight loads.
        if g not in cache:
            parts = [src.get(n) for n in names[g]]
            cache[g] = transform(np.stack(parts) if per_expert else parts[0], cfg)
        return cache[g]

    np_dtype = np.dtype(info.dtype)

    def callback(index):
        if stacked:
            layer_ix, rest = index[0], index[1:]
            parts = [tensor(g)[rest] for g in range(len(names))[layer_ix]]
            return np.stack(parts).astype(np_dtype)
        return np.asarray(tensor(0)[index]).astype(np_dtype)

    arr = jax.make_array_from_callback(info.shape, sharding, callback)
    cache.clear()
    return arr
