"""Routed experts (Qwen3-MoE, gpt-oss) with expert parallelism.

Each token picks `top_k` experts from its router logits. The (token, expert) pairs are sorted
by expert and run as one grouped matmul in blocks (`_local_experts`), so compute follows the
routed tokens, not tokens x experts.

Expert parallelism: the expert dimension of every expert weight has the logical axis
`experts`, which `sharding.RULES` maps onto a mesh axis. Under a mesh the expert MLP runs in
`shard_map`: the tokens of a batch shard are replicated along the expert axis (as they already
are for the tensor-parallel attention), each device runs the pairs routed to its own experts,
and one all-reduce over the expert axis sums the partial outputs: the same collective, on the
same [B, T, D] tensor, as a tensor-parallel dense MLP. No all-to-all is needed because every
device already holds its batch shard's tokens.

Shape letters: B batch, T tokens, D hidden, E experts (El on one device), F expert width,
N = B*T tokens, P = N*top_k routed pairs.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from eagle3kit.core.config import MoeConfig
from eagle3kit.core.sharding import active_mesh, mesh_axis, spec_for


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class ExpertWeights:
    """One layer's (or, stacked, every sparse layer's) router and experts, (in, out) layout."""

    router: Any  # D,E
    gate: Any  # E,D,F
    up: Any  # E,D,F
    down: Any  # E,F,D
    router_bias: Any = None  # E (gpt-oss)
    gate_bias: Any = None  # E,F
    up_bias: Any = None  # E,F
    down_bias: Any = None  # E,D


# logical axes of one layer's expert weights (the stacked ones add "layers" in front)
AXES = {
    "router": ("embed", None), "router_bias": (None,),
    "gate": ("experts", "embed", "expert_ffw"), "up": ("experts", "embed", "expert_ffw"),
    "down": ("experts", "expert_ffw", "embed"),
    "gate_bias": ("experts", "expert_ffw"), "up_bias": ("experts", "expert_ffw"),
    "down_bias": ("experts", "embed"),
}


def route(x_NxD: jax.Array, w: ExpertWeights, cfg: MoeConfig) -> tuple[jax.Array, jax.Array]:
    """Top-k expert ids [N, k] and their weights [N, k] (in x's dtype)."""
    logits = jnp.einsum("nd,de->ne", x_NxD, w.router)
    if w.router_bias is not None:
        logits = logits + w.router_bias
    logits = logits.astype(jnp.float32)
    if cfg.routing == "topk_softmax":
        top, ids = jax.lax.top_k(logits, cfg.top_k)
        probs = jax.nn.softmax(top, axis=-1)
    else:
        probs, ids = jax.lax.top_k(jax.nn.softmax(logits, axis=-1), cfg.top_k)
        if cfg.norm_topk_prob:
            probs = probs / probs.sum(axis=-1, keepdims=True)
    return ids, probs.astype(x_NxD.dtype)


def _activation(g: jax.Array, u: jax.Array, cfg: MoeConfig) -> jax.Array:
    if not cfg.swiglu_limit:
        return jax.nn.silu(g) * u
    g = jnp.minimum(g, cfg.swiglu_limit)
    u = jnp.clip(u, -cfg.swiglu_limit, cfg.swiglu_limit)
    return (u + 1) * (g * jax.nn.sigmoid(g * cfg.swiglu_alpha))


# Rows per block of the grouped matmul: each expert's pairs are padded to a multiple of it.
BLOCK = 128


def _local_experts(x_NxD, ids_NxK, probs_NxK, w: ExpertWeights, first_expert, cfg: MoeConfig):
    """Sum over the pairs routed to experts first_expert..first_expert+El-1 held here.

    A grouped matmul in blocks: pairs sorted by expert, each expert's run padded to whole
    blocks of BLOCK rows, then one batched matmul of every block with its expert's weight.
    Exact (no capacity, nothing dropped), static shapes, backend-independent, and the padding
    costs at most El * (BLOCK - 1) rows. (`lax.ragged_dot` would avoid it, but without a
    grouped-GEMM kernel it lowers to a dense [experts, pairs, D] product.)
    """
    n, k = ids_NxK.shape
    d = x_NxD.shape[1]
    e_local = w.gate.shape[0]
    p = n * k
    local = ids_NxK.reshape(-1) - first_expert
    key_P = jnp.where((local >= 0) & (local < e_local), local, e_local)  # e_local: elsewhere
    order = jnp.argsort(key_P, stable=True)
    key_P = key_P[order]
    rows_P = order // k
    here = key_P < e_local
    expert_P = jnp.minimum(key_P, e_local - 1)
    counts = jnp.bincount(key_P, length=e_local + 1)[:e_local]
    padded = (counts + BLOCK - 1) // BLOCK * BLOCK
    blocks = -(-(p + e_local * (BLOCK - 1)) // BLOCK)  # static bound on the padded blocks
    r = blocks * BLOCK
    # where each sorted pair goes in the padded layout (row r: dropped, another device's)
    rank_P = jnp.arange(p) - (jnp.cumsum(counts) - counts)[expert_P]
    dest_P = jnp.where(here, (jnp.cumsum(padded) - padded)[expert_P] + rank_P, r)
    x_RxD = jnp.zeros((r, d), x_NxD.dtype).at[dest_P].set(x_NxD[rows_P], mode="drop")
    block_expert = jnp.minimum(
        jnp.searchsorted(jnp.cumsum(padded), jnp.arange(blocks) * BLOCK, side="right"),
        e_local - 1)
    xb = x_RxD.reshape(blocks, BLOCK, d)
    g = jnp.einsum("bcd,bdf->bcf", xb, w.gate[block_expert])
    u = jnp.einsum("bcd,bdf->bcf", xb, w.up[block_expert])
    if w.gate_bias is not None:
        g = g + w.gate_bias[block_expert][:, None]
        u = u + w.up_bias[block_expert][:, None]
    y = jnp.einsum("bcf,bfd->bcd", _activation(g, u, cfg), w.down[block_expert])
    if w.down_bias is not None:
        y = y + w.down_bias[block_expert][:, None]
    y_PxD = y.reshape(r, d).at[dest_P].get(mode="fill", fill_value=0)
    weight_P = jnp.where(here, probs_NxK.reshape(-1)[order], 0)
    return jnp.zeros((n, d), jnp.float32).at[rows_P].add(
        (y_PxD * weight_P[:, None]).astype(jnp.float32))


def moe_mlp(x_BxTxD: jax.Array, w: ExpertWeights, cfg: MoeConfig) -> jax.Array:
    """The routed-experts MLP of one layer -> [B, T, D]."""
    b, t, d = x_BxTxD.shape

    def tokens(x_BxTxD, w, first_expert):  # routing and this device's experts
        bl = x_BxTxD.shape[0]
        x_NxD = x_BxTxD.reshape(bl * t, d)
        ids, probs = route(x_NxD, w, cfg)
        out = _local_experts(x_NxD, ids, probs, w, first_expert, cfg)
        return out.reshape(bl, t, d).astype(x_BxTxD.dtype)

    with jax.named_scope("moe"):
        mesh = active_mesh()
        if mesh is None or mesh.size == 1:
            return tokens(x_BxTxD, w, 0)
        expert_axis = mesh_axis("experts")
        batch_axis = mesh_axis("batch")
        if batch_axis is not None and b % mesh.shape[batch_axis]:
            batch_axis = None  # an odd batch stays replicated
        specs = {f.name: spec_for(AXES[f.name]) for f in dataclasses.fields(w)
                 if getattr(w, f.name) is not None}
        present = {name: getattr(w, name) for name in specs}

        def local(x, ws):
            first = 0 if expert_axis is None else (
                jax.lax.axis_index(expert_axis) * ws["gate"].shape[0])
            out = tokens(x, ExpertWeights(**ws), first)
            # the one collective: as a tensor-parallel MLP's all-reduce, in the model dtype
            return out if expert_axis is None else jax.lax.psum(out, expert_axis)

        # routing runs inside too: each device routes its own batch shard (the router is
        # replicated), so no token or routing result crosses devices
        return jax.shard_map(local, mesh=mesh, in_specs=(PartitionSpec(batch_axis), specs),
                             out_specs=PartitionSpec(batch_axis))(x_BxTxD, present)
