"""One sharding table, from logical axis names to mesh axes, and the mesh itself.

Every array in eagle3kit names its dimensions logically (`ArrayInfo.axes`, activation
constraints). `RULES` maps those names onto the two mesh axes:

- `data`: the batch is split here; weights are replicated along it.
- `tensor`: Megatron-style tensor parallelism of the target: attention heads, MLP width and
  vocabulary are split, so an 8B target's weights are spread over the `tensor` devices.
  Routed experts are split over the same axis (expert parallelism, `core/moe.py`): whole
  experts per device, one all-reduce per MoE layer, as for a dense tensor-parallel MLP.

Changing the parallel layout means editing `RULES`, nothing else.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import math
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from eagle3kit.errors import ResourceError, UserError

MESH_AXES = ("data", "tensor")

RULES: dict[str, str | None] = {
    # activations
    "batch": "data",
    "seq": None,
    "act_embed": None,
    "act_heads": "tensor",
    "act_vocab": "tensor",
    # weights
    "layers": None,
    "embed": None,
    "heads": "tensor",
    "kv_heads": "tensor",
    "head_dim": None,
    "ffw": "tensor",
    "vocab": "tensor",
    "experts": "tensor",  # expert parallelism: whole experts per device (docs/architecture.md)
    "expert_ffw": None,
    # the draft head is small and replicated: no collectives inside the K-step rollout
    "draft": None,
}


@dataclasses.dataclass(frozen=True)
class ArrayInfo:
    """Abstract description of one weight: shape, dtype, logical axes and initializer."""

    shape: tuple[int, ...]
    dtype: Any
    axes: tuple[str | None, ...]
    init: Callable[[jax.Array, tuple[int, ...], Any], jax.Array] | None = None


def is_info(x: Any) -> bool:
    return isinstance(x, ArrayInfo)


def parse_mesh_spec(spec: str | None, num_devices: int) -> tuple[int, int]:
    """`"data=4,tensor=2"` -> (4, 2). Missing axes fill up the devices (data first)."""
    sizes = {"data": None, "tensor": None}
    for part in (spec or "").split(","):
        if not part.strip():
            continue
        name, _, value = part.partition("=")
        name = name.strip()
        if name not in sizes or not value.strip().isdigit() or int(value) < 1:
            raise UserError(f"bad --mesh {spec!r}: expected e.g. data=4,tensor=2")
        sizes[name] = int(value)
    data, tensor = sizes["data"], sizes["tensor"]
    if tensor is None:
        tensor = 1 if data is None else max(num_devices // data, 1)
    if data is None:
        data = max(num_devices // tensor, 1)
    if num_devices % (data * tensor) or (data * tensor != num_devices
                                         and jax.process_count() > 1):
        raise ResourceError(
            f"--mesh data={data},tensor={tensor} needs {data * tensor} devices, "
            f"but {num_devices} are visible ({jax.default_backend()}); the mesh must use all "
            "devices or (on one host) a divisor of them")
    return data, tensor


def make_mesh(spec: str | None = None, devices: list | None = None) -> Mesh:
    """Builds the (data, tensor) mesh from `"data=D,tensor=T"` over all (or the given) devices."""
    devices = list(jax.devices()) if devices is None else list(devices)
    data, tensor = parse_mesh_spec(spec, len(devices))
    devices = devices[: data * tensor]  # a smaller explicit mesh uses the first devices
    # tensor is the fastest-varying axis so that tensor-parallel peers sit on one host.
    grid = np.array(devices, dtype=object).reshape(data, tensor)
    return Mesh(grid, MESH_AXES)


def spec_for(axes: tuple[str | None, ...]) -> PartitionSpec:
    return PartitionSpec(*(RULES.get(a) if a else None for a in axes))


def sharding_for(info: ArrayInfo, mesh: Mesh, name: str = "") -> NamedSharding:
    """The sharding of one weight; a dimension the mesh cannot divide is a clear error."""
    spec = spec_for(info.axes)
    for dim, axis in zip(info.shape, spec, strict=False):
        if axis is not None and dim % mesh.shape[axis]:
            raise UserError(
                f"cannot shard {name or 'a weight'} of shape {info.shape}: its "
                f"{info.axes[list(spec).index(axis)]} dimension {dim} is not divisible by "
                f"{axis}={mesh.shape[axis]}; choose a --mesh whose {axis} size divides it")
    return NamedSharding(mesh, spec)


def shardings(abstract: Any, mesh: Mesh) -> Any:
    """Maps a pytree of `ArrayInfo` to a pytree of `NamedSharding`."""
    leaves, treedef = jax.tree_util.tree_flatten_with_path(abstract, is_leaf=is_info)
    out = [sharding_for(info, mesh, jax.tree_util.keystr(path)) for path, info in leaves]
    return jax.tree_util.tree_unflatten(treedef, out)


def shape_dtypes(abstract: Any, mesh: Mesh | None = None) -> Any:
    """Maps a pytree of `ArrayInfo` to `jax.ShapeDtypeStruct`s (sharded when `mesh` is given):
    what `jax.eval_shape` and memory estimates take instead of weights."""
    def one(info: ArrayInfo, sh=None):
        return jax.ShapeDtypeStruct(info.shape, info.dtype, sharding=sh)
    if mesh is None:
        return jax.tree.map(one, abstract, is_leaf=is_info)
    return jax.tree.map(one, abstract, shardings(abstract, mesh), is_leaf=is_info)


def init_weights(abstract: Any, key: jax.Array, mesh: Mesh | None = None) -> Any:
    """Initialises every weight from its `ArrayInfo`, jitted straight into its sharding."""
    leaves, treedef = jax.tree_util.tree_flatten(abstract, is_leaf=is_info)
    keys = list(jax.random.split(key, len(leaves)))

    def init(keys):
        out = [info.init(k, info.shape, info.dtype) for info, k in zip(leaves, keys, strict=True)]
        return jax.tree_util.tree_unflatten(treedef, out)

    out_shardings = shardings(abstract, mesh) if mesh is not None else None
    return jax.jit(init, out_shardings=out_shardings)(keys)


def normal_init(std: float = 0.02):
    def init(key, shape, dtype):
        return (std * jax.random.normal(key, shape, jnp.float32)).astype(dtype)
    return init


def fan_in_init(fan_in_dims: int = 1):
    """Kaiming-uniform over the leading `fan_in_dims` dimensions, as torch.nn.Linear does."""
    def init(key, shape, dtype):
        bound = 1.0 / math.sqrt(math.prod(shape[:fan_in_dims]))
        return jax.random.uniform(key, shape, jnp.float32, -bound, bound).astype(dtype)
    return init


def ones_init(key, shape, dtype):
    return jnp.ones(shape, dtype)


def zeros_init(key, shape, dtype):
    return jnp.zeros(shape, dtype)


def to_host(tree: Any) -> Any:
    """Numpy copies of a pytree of (possibly multi-host) arrays.

    A replicated array that spans other hosts' devices cannot be fetched whole; every host
    holds a full copy on its own devices, so the local copy is read instead.
    """
    def one(x):
        if isinstance(x, jax.Array) and not x.is_fully_addressable:
            if not x.sharding.is_fully_replicated:
                raise ValueError("to_host: a sharded multi-host array cannot be fetched")
            return np.asarray(x.addressable_data(0))
        return np.asarray(jax.device_get(x))
    return jax.tree.map(one, tree)


# ---- activation constraints ---------------------------------------------------------------

_ACTIVE: contextvars.ContextVar[Mesh | None] = contextvars.ContextVar("mesh", default=None)


@contextlib.contextmanager
def use_mesh(mesh: Mesh | None) -> Iterator[None]:
    """Within this context, `constrain` pins activations to `mesh` (at trace time)."""
    token = _ACTIVE.set(mesh)
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def active_mesh() -> Mesh | None:
    """The mesh of the enclosing `use_mesh`, if any."""
    return _ACTIVE.get()


def mesh_axis(logical: str) -> str | None:
    """The mesh axis a logical axis maps to (for collectives inside `shard_map`)."""
    return RULES.get(logical)


def batch_ways(mesh: Mesh) -> int:
    """How many ways the mesh splits a batch (rows must be a multiple of it)."""
    axis = RULES["batch"]
    return mesh.shape[axis] if axis else 1


def constrain(x: jax.Array, axes: tuple[str | None, ...]) -> jax.Array:
    """Sharding constraint by logical axes; a no-op outside `use_mesh` or on one device."""
    mesh = _ACTIVE.get()
    if mesh is None or mesh.size == 1:
        return x
    spec = spec_for(axes)
    # leave a dimension unconstrained when the mesh does not divide it (e.g. odd batch)
    spec = PartitionSpec(*(a if a is None or x.shape[i] % mesh.shape[a] == 0 else None
                           for i, a in enumerate(spec)))
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))
