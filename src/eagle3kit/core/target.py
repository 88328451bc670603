"""The target model in pure JAX: Llama, Qwen2, Qwen3, Qwen3-MoE, gpt-oss and Gemma-3 (text)
forward with hidden-state capture.

Layers are stacked along a leading `layers` axis and run under `lax.scan`, so an 8B target
compiles as one layer. What varies per layer (sliding window or full attention, which rope,
dense MLP or routed experts) is indexed by the layer inside the scan, never a second
compiled layer. Training and decoding unstack the layers first (`LayerList`, looped in
Python): a longer compile, but no per-layer copy of the weights out of the stack. Two seams
make one forward serve every use: `kv_fn` supplies keys (training: the layer's own;
decoding: a cache) and `mlp_fn` the MLP (dense or `core.moe`). The forward captures the
residual stream entering the configured layers (HF `hidden_states[i]`), which the EAGLE3
draft reads, and optionally reads/writes a KV cache for decoding.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from eagle3kit.core import moe
from eagle3kit.core.blocks import attend_general, gated_mlp, gemma_rms_norm, window_mask
from eagle3kit.core.config import TargetConfig
from eagle3kit.core.layers import attend, causal_mask, rms_norm, rope
from eagle3kit.core.sharding import (
    ArrayInfo,
    constrain,
    fan_in_init,
    normal_init,
    ones_init,
    zeros_init,
)

# The weights each layer variant adds to the Llama layer, by the `TargetConfig` flag that a
# family's `fields` sets (core/families): weight -> (its dimensions, as letters of the shape
# legend, and its initializer: "normal", or "norm" as the config's norms).
LAYER_VARIANTS = {
    "attention_bias": {"q_bias": ("LNH", "normal"), "k_bias": ("LKH", "normal"),
                       "v_bias": ("LKH", "normal")},  # Qwen2, gpt-oss
    "qk_norm": {"q_norm": ("LH", "norm"), "k_norm": ("LH", "norm")},  # Qwen3(-MoE), Gemma-3
    # gpt-oss: sinks and an output bias come together
    "attention_sinks": {"sinks": ("LN", "normal"), "o_bias": ("LD", "normal")},
    "gemma_norms": {"post_attn_norm": ("LD", "norm"), "post_mlp_norm": ("LD", "norm")},
}
_AXES = {"L": "layers", "D": "embed", "N": "heads", "K": "kv_heads", "H": "head_dim"}


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class TargetLayers:
    """Attention and norms of every decoder layer, stacked on axis 0 (L); (in, out) layout."""

    attn_norm: Any  # L,D
    q: Any  # L,D,N,H
    k: Any  # L,D,K,H
    v: Any  # L,D,K,H
    o: Any  # L,N,H,D
    mlp_norm: Any  # L,D
    # a layer variant's weights (LAYER_VARIANTS), None where the config's flag is off
    q_bias: Any = None  # L,N,H
    k_bias: Any = None  # L,K,H
    v_bias: Any = None  # L,K,H
    q_norm: Any = None  # L,H
    k_norm: Any = None  # L,H
    o_bias: Any = None  # L,D
    sinks: Any = None  # L,N
    post_attn_norm: Any = None  # L,D: norms the attention output
    post_mlp_norm: Any = None  # L,D: norms the MLP output
    # a `LayerList`'s layers hold q, k and v as one matrix instead (`fuse_layer`)
    qkv: Any = None  # D,K,G+2,H: kv head k's G query heads, then its key and its value
    qkv_bias: Any = None  # K,G+2,H


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class DenseMLP:
    """Gated MLPs of the dense layers, stacked (every layer, or Qwen3-MoE's `mlp_only_layers`)."""

    gate: Any  # Ld,D,F
    up: Any  # Ld,D,F
    down: Any  # Ld,F,D
    gate_up: Any = None  # D,2,F: a `LayerList`'s gate and up as one matrix (`fuse_layer`)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class TargetWeights:
    embed: Any  # V,D
    layers: TargetLayers
    final_norm: Any  # D
    lm_head: Any = None  # D,V; None when tied to `embed`
    mlp: DenseMLP | None = None  # the dense layers' MLPs
    experts: moe.ExpertWeights | None = None  # the sparse layers' routed experts, stacked

    @staticmethod
    def abstract(cfg: TargetConfig, dtype: Any = jnp.bfloat16) -> TargetWeights:
        """`ArrayInfo` for every weight of `cfg` (nothing allocated)."""
        L, D, F = cfg.num_layers, cfg.hidden_size, cfg.intermediate_size
        N, K, H, V = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.vocab_size

        def info(shape, axes, init=None):
            return ArrayInfo(tuple(shape), dtype, tuple(axes), init or fan_in_init(2))

        lin = fan_in_init(2)  # fan-in is the D (or N*H) dimension after the layer axis
        norm = zeros_init if cfg.gemma_norms else ones_init  # Gemma stores w of (1 + w)
        layers = TargetLayers(
            attn_norm=info((L, D), ("layers", "embed"), norm),
            q=info((L, D, N, H), ("layers", "embed", "heads", "head_dim"), lin),
            k=info((L, D, K, H), ("layers", "embed", "kv_heads", "head_dim"), lin),
            v=info((L, D, K, H), ("layers", "embed", "kv_heads", "head_dim"), lin),
            o=info((L, N, H, D), ("layers", "heads", "head_dim", "embed"), fan_in_init(3)),
            mlp_norm=info((L, D), ("layers", "embed"), norm),
        )
        sizes = {"L": L, "D": D, "N": N, "K": K, "H": H}
        for flag, weights in LAYER_VARIANTS.items():
            for name, (dims, init) in weights.items() if getattr(cfg, flag) else ():
                setattr(layers, name, info([sizes[c] for c in dims], [_AXES[c] for c in dims],
                                           norm if init == "norm" else normal_init()))
        sparse = cfg.moe.sparse_layers if cfg.moe else (False,) * L
        n_dense, mlp, experts = L - sum(sparse), None, None
        if n_dense:
            mlp = DenseMLP(
                gate=info((n_dense, D, F), ("layers", "embed", "ffw"), lin),
                up=info((n_dense, D, F), ("layers", "embed", "ffw"), lin),
                down=info((n_dense, F, D), ("layers", "ffw", "embed"), lin))
        if cfg.moe is not None:
            m = cfg.moe
            shapes = {"router": (D, m.num_experts), "gate": (m.num_experts, D, m.expert_size),
                      "up": (m.num_experts, D, m.expert_size),
                      "down": (m.num_experts, m.expert_size, D)}
            if m.bias:
                shapes.update(router_bias=(m.num_experts,), gate_bias=shapes["gate"][::2],
                              up_bias=shapes["up"][::2], down_bias=(m.num_experts, D))
            experts = moe.ExpertWeights(**{
                name: info((m.num_sparse, *shape), ("layers", *moe.AXES[name]),
                           normal_init() if "bias" in name else lin)
                for name, shape in shapes.items()})
        return TargetWeights(
            embed=info((V, D), ("vocab", "embed"), normal_init()),
            layers=layers,
            final_norm=info((D,), ("embed",), norm),
            lm_head=None if cfg.tie_word_embeddings else info((D, V), ("embed", "vocab"),
                                                              normal_init()),
            mlp=mlp,
            experts=experts,
        )


def lm_head_weight(w: TargetWeights) -> jax.Array:
    """[D, V]: the untied head, or the embedding transposed when tied."""
    return w.embed.T if w.lm_head is None else w.lm_head


def embed_tokens(w: TargetWeights, tokens_BxT: jax.Array) -> jax.Array:
    return constrain(jnp.take(w.embed, tokens_BxT, axis=0), ("batch", "seq", "act_embed"))


def _embed(w, cfg: TargetConfig, tokens_BxT: jax.Array) -> jax.Array:
    x = embed_tokens(w, tokens_BxT)
    if cfg.gemma_norms:  # Gemma scales the embeddings by sqrt(D), rounded to the weight dtype
        x = x * jnp.asarray(math.sqrt(x.shape[-1]), x.dtype)
    return x


@dataclasses.dataclass(frozen=True)
class _LayerTables:
    """Per-layer attention variation as arrays indexed by the (traced) layer index, so local
    and global layers, and dense and sparse ones, run as one compiled scanned layer."""

    inv_freq_RxH2: jax.Array  # one row per distinct rope
    rope_scale: tuple[float, ...]  # cos/sin factor per rope (YaRN), static
    rope_index_L: jax.Array
    window_L: jax.Array | None  # 0 = full attention; None: no layer has a window


def _tables(cfg: TargetConfig) -> _LayerTables:
    ropes = cfg.rope_for_layer()
    return _LayerTables(
        inv_freq_RxH2=jnp.asarray(np.stack([r.inv_freq(cfg.head_dim) for r in ropes])),
        rope_scale=tuple(r.attention_scaling for r in ropes),
        rope_index_L=jnp.asarray(cfg.layer_rope_index(), jnp.int32),
        window_L=jnp.asarray(cfg.layer_windows, jnp.int32) if any(cfg.layer_windows) else None,
    )


def _rope(x_BxTxNxH, positions_BxT, tables: _LayerTables, r):
    out = rope(x_BxTxNxH, positions_BxT, tables.inv_freq_RxH2[r])
    if any(s != 1.0 for s in tables.rope_scale):
        out = out * jnp.asarray(tables.rope_scale, out.dtype)[r]
    return out


def _mlp_for(cfg: TargetConfig, sparse: bool):
    if sparse:
        return lambda h, layer, ew, matmul=None: moe.moe_mlp(h, ew, cfg.moe)
    return lambda h, layer, mw, matmul=None: gated_mlp(
        h, mw.gate, mw.up, mw.down, cfg.mlp_activation, mw.gate_up, matmul)


def _mlp_seam(w: TargetWeights, cfg: TargetConfig):
    """(per-layer scanned MLP weights or None, mlp_fn(h, layer, scanned, matmul=None) ->
    [B, T, D]; `matmul`, a decode step's, only reaches per-layer weights, never a scan).

    When every layer's MLP has the same kind its weights are scanned along with the layers;
    a mixed Qwen3-MoE stack (`mlp_only_layers`, `decoder_sparse_step`) indexes the dense or
    the expert stack by layer and picks the branch with `lax.cond`.
    """
    dense, sparse = _mlp_for(cfg, False), _mlp_for(cfg, True)
    if w.experts is None:
        return w.mlp, dense
    if w.mlp is None:
        return w.experts, sparse
    flags = np.asarray(cfg.moe.sparse_layers)
    slot = jnp.asarray(np.where(flags, np.cumsum(flags) - 1, np.cumsum(~flags) - 1), jnp.int32)
    is_sparse = jnp.asarray(flags)

    def take(stack, i):
        return jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, i, keepdims=False), stack)

    def mixed(h, layer, _, matmul=None):
        return jax.lax.cond(is_sparse[layer],
                            lambda: sparse(h, layer, take(w.experts, slot[layer])),
                            lambda: dense(h, layer, take(w.mlp, slot[layer])))
    return None, mixed


class LayerAttention:
    """A layer's whole attention, passed where a `kv_fn` goes: called as
    `(q, k, v, layer, sinks) -> [B, T, N, H]`, and its `matmul(x, w)` runs q|k|v, o_proj and
    the MLP's down projection. Decoding's rows over a cache are one
    (`decode/row_cache.RowAttention`): the target does not know how a cache is laid out."""

    def matmul(self, x_BxTxK: jax.Array, w_KxN: jax.Array) -> jax.Array:
        return jnp.einsum("btk,kn->btn", x_BxTxK, w_KxN)


def _layer(x_BxTxD, lw: TargetLayers, cfg: TargetConfig, positions_BxT, tables, kv_fn, mlp_fn,
           mw, layer, extra, attn_impl: str = "xla"):
    """One decoder layer (index `layer`).

    `kv_fn(k, v, layer, extra) -> (k_all, v_all, mask, key_positions, extra)` supplies the keys
    to attend to: the layer's own (training) or a KV cache it updates (decoding), with the
    position of every key (for sliding windows). A `LayerAttention` instead takes the whole
    attention over (decoding rows: `decode/row_cache.forward_rows`), and its `matmul` then runs
    q|k|v, o_proj and the MLP's down projection. `mlp_fn(h, layer, mw, matmul)` is the layer's MLP.
    """
    matmul = kv_fn.matmul if isinstance(kv_fn, LayerAttention) else None
    norm = gemma_rms_norm if cfg.gemma_norms else rms_norm
    eps = cfg.rms_norm_eps
    # named scopes split a profile of the layer (benchmarks/profile_summary.py)
    with jax.named_scope("attention"):
        with jax.named_scope("qkv"):
            q, k, v = _qkv(norm(x_BxTxD, lw.attn_norm, eps), lw, cfg, matmul)
            if lw.q_norm is not None:
                q, k = norm(q, lw.q_norm, eps), norm(k, lw.k_norm, eps)
            r = tables.rope_index_L[layer]
            q = constrain(_rope(q, positions_BxT, tables, r), ("batch", "seq", "act_heads", None))
            k = constrain(_rope(k, positions_BxT, tables, r), ("batch", "seq", "act_heads", None))
            v = constrain(v, ("batch", "seq", "act_heads", None))
        if isinstance(kv_fn, LayerAttention):
            a = kv_fn(q, k, v, layer, lw.sinks)  # its own scopes: cache_write, attend
        else:
            with jax.named_scope("attend"):
                k_all, v_all, mask, key_positions, extra = kv_fn(k, v, layer, extra)
                if tables.window_L is not None:
                    mask = window_mask(mask, positions_BxT, key_positions,
                                       tables.window_L[layer])
                a = attend_layer(cfg, q, k_all, v_all, mask, lw.sinks, attn_impl)
        with jax.named_scope("o_proj"):
            x_BxTxD = x_BxTxD + _o_proj(a, lw, matmul, norm, eps)
    with jax.named_scope("mlp"):
        h = mlp_fn(norm(x_BxTxD, lw.mlp_norm, eps), layer, mw, matmul)
        if lw.post_mlp_norm is not None:
            h = norm(h, lw.post_mlp_norm, eps)
        x_BxTxD = x_BxTxD + h
    return constrain(x_BxTxD, ("batch", "seq", "act_embed")), extra


def _qkv(h_BxTxD, lw: TargetLayers, cfg: TargetConfig, matmul):
    """q [B,T,N,H], k and v [B,T,K,H] of the normed input: one matmul over a `LayerList`'s
    fused q|k|v (through `matmul` when a `LayerAttention` gives one), else three."""
    if lw.qkv is None:
        q = jnp.einsum("btd,dnh->btnh", h_BxTxD, lw.q)
        k = jnp.einsum("btd,dkh->btkh", h_BxTxD, lw.k)
        v = jnp.einsum("btd,dkh->btkh", h_BxTxD, lw.v)
        if lw.q_bias is not None:
            q, k, v = q + lw.q_bias, k + lw.k_bias, v + lw.v_bias
        return q, k, v
    d, kv, c, hd = lw.qkv.shape
    qkv = (jnp.einsum("btd,dkch->btkch", h_BxTxD, lw.qkv) if matmul is None else
           matmul(h_BxTxD, lw.qkv.reshape(d, -1)).reshape(*h_BxTxD.shape[:2], kv, c, hd))
    if lw.qkv_bias is not None:
        qkv = qkv + lw.qkv_bias
    g = cfg.num_heads // cfg.num_kv_heads
    q = qkv[:, :, :, :g].reshape(*qkv.shape[:2], cfg.num_heads, cfg.head_dim)
    return q, qkv[:, :, :, g], qkv[:, :, :, g + 1]


def _o_proj(a_BxTxNxH, lw: TargetLayers, matmul, norm, eps: float) -> jax.Array:
    """[B,T,D]: the attention's output projected (its bias added, normed when the layer
    norms it: Gemma-3), before the residual."""
    if matmul is None:
        o = jnp.einsum("btnh,nhd->btd", a_BxTxNxH, lw.o)
    else:
        o = matmul(a_BxTxNxH.reshape(*a_BxTxNxH.shape[:2], -1), lw.o.reshape(-1, lw.o.shape[-1]))
    if lw.o_bias is not None:
        o = o + lw.o_bias
    if lw.post_attn_norm is not None:
        o = norm(o, lw.post_attn_norm, eps)
    return o


def attend_layer(cfg: TargetConfig, q, k_all, v_all, mask, sinks, attn_impl: str = "xla"):
    """The layer's softmax attention under `mask` (windows already in it): cuDNN or XLA for
    plain layers, the general XLA attention for sinks, query scales and soft-capping."""
    if sinks is None and not cfg.query_scale and not cfg.attn_softcap:
        return attend(q, k_all, v_all, mask, attn_impl)
    return attend_general(q, k_all, v_all, mask, cfg.query_scale or cfg.head_dim ** -0.5,
                          cfg.attn_softcap, sinks)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TargetOutput:
    hidden_BxTxD: jax.Array  # final-normed hidden state (input of the lm head)
    aux_BxTxA: jax.Array | None  # captured states concatenated, A = len(aux_layer_ids) * D;
    # None when no layer is captured (`aux_layer_ids=()`, plain generation)


def _check_aux_ids(cfg: TargetConfig, ids: tuple[int, ...]) -> None:
    for i in ids:
        if not 0 <= i < cfg.num_layers:
            raise ValueError(f"aux layer id {i} outside 0..{cfg.num_layers - 1}")


def _capture_slots(cfg: TargetConfig, unique_ids: tuple[int, ...]) -> jax.Array:
    """slot[layer] = position of that layer in `unique_ids`, or len(ids) (a scratch slot)."""
    _check_aux_ids(cfg, unique_ids)
    slots = [len(unique_ids)] * cfg.num_layers
    for j, i in enumerate(unique_ids):
        slots[i] = j
    return jnp.asarray(slots, jnp.int32)


def _scan_layers(w: TargetWeights, cfg: TargetConfig, tokens_BxT, positions_BxT,
                 aux_layer_ids, kv_fn, extra, attn_impl: str = "xla"):
    """Runs the stacked layers, writing the input of each captured layer into its slot.

    Capturing costs one [B,T,D] write per layer (uncaptured layers write a scratch slot)
    instead of keeping every layer's output.
    """
    tables = _tables(cfg)
    mlp_xs, mlp_fn = _mlp_seam(w, cfg)
    unique = tuple(sorted(set(aux_layer_ids)))
    slots = _capture_slots(cfg, unique)
    n = len(unique)
    x = _embed(w, cfg, tokens_BxT)
    b, t, d = x.shape
    # no capture asked (plain generation): no aux buffer and no per-layer write at all
    aux = jnp.zeros((n + 1, b, t, d), x.dtype) if n else None

    def body(carry, xs):
        x, aux, extra = carry
        lw, mw, layer = xs
        if n:
            aux = jax.lax.dynamic_update_slice(aux, x[None], (slots[layer], 0, 0, 0))
        x, extra = _layer(x, lw, cfg, positions_BxT, tables, kv_fn, mlp_fn, mw, layer, extra,
                          attn_impl)
        return (x, aux, extra), None

    (x, aux, extra), _ = jax.lax.scan(body, (x, aux, extra),
                                      (w.layers, mlp_xs, jnp.arange(cfg.num_layers)))
    x = (gemma_rms_norm if cfg.gemma_norms else rms_norm)(x, w.final_norm, cfg.rms_norm_eps)
    if not n:
        return TargetOutput(x, None), extra
    order = [unique.index(i) for i in aux_layer_ids]  # ids may repeat on tiny models
    aux_BxTxA = jnp.moveaxis(aux[jnp.asarray(order)], 0, 2).reshape(b, t, len(order) * d)
    return TargetOutput(x, constrain(aux_BxTxA, ("batch", "seq", "act_embed"))), extra


def forward(w: TargetWeights | LayerList, cfg: TargetConfig, tokens_BxT: jax.Array,
            segment_ids_BxT: jax.Array | None = None, positions_BxT: jax.Array | None = None,
            aux_layer_ids: tuple[int, ...] | None = None, attn_impl: str = "xla"
            ) -> TargetOutput:
    """Full-sequence forward (training, teacher-forced eval).

    `segment_ids` (0 = padding) keep packed documents apart; `positions` restart per document.
    Returns the final-normed hidden state and the captured auxiliary states.
    `attn_impl`: "xla" or "cudnn" (see layers.attend). Stacked weights run as one scanned
    layer; a `LayerList` (the trainer's, see `unstack_in_place`) as one block per layer.
    """
    aux_layer_ids = cfg.default_aux_layer_ids() if aux_layer_ids is None else aux_layer_ids
    b, t = tokens_BxT.shape
    if segment_ids_BxT is None:
        segment_ids_BxT = jnp.ones((b, t), jnp.int32)
    if positions_BxT is None:
        positions_BxT = jnp.broadcast_to(jnp.arange(t), (b, t))
    mask = causal_mask(segment_ids_BxT)

    def kv_fn(k, v, layer, extra):
        return k, v, mask, positions_BxT, extra

    if isinstance(w, LayerList):
        return loop_layers(w, cfg, tokens_BxT, positions_BxT, kv_fn, aux_layer_ids, attn_impl)
    out, _ = _scan_layers(w, cfg, tokens_BxT, positions_BxT, aux_layer_ids, kv_fn, None,
                          attn_impl)
    return out


def logits(w: TargetWeights, hidden_BxTxD: jax.Array) -> jax.Array:
    """[B, T, V] logits from the final-normed hidden state."""
    out = jnp.einsum("btd,dv->btv", hidden_BxTxD, lm_head_weight(w))
    return constrain(out, ("batch", "seq", "act_vocab"))


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class LayerList:
    """A target with its layers unstacked, for decoding and training.

    Scanning stacked layers makes XLA copy each layer's weights (and cache) out of the stack
    at every step: where decoding is bound by reading the weights once per step, that
    doubles the traffic (those copies were most of a decode step's profile,
    docs/benchmarks.md), and in a training step the copies are a small part of the time. Both therefore loop over per-layer arrays (one
    compiled body per layer: a longer compile, and for training a forward-only one).
    `mlps[i]` is layer i's `DenseMLP` or `moe.ExpertWeights` slice. A decoder's layers hold
    q|k|v and a dense MLP's gate|up as one matrix each (`fuse_layer`), the trainer's apart.
    """

    embed: Any  # V,D
    layers: list  # [TargetLayers], one per layer
    mlps: list
    final_norm: Any
    lm_head: Any = None


def _sparse_layers(cfg: TargetConfig) -> tuple[bool, ...]:
    return cfg.moe.sparse_layers if cfg.moe else (False,) * cfg.num_layers


def fuse_layer(lw: TargetLayers, mw: Any, shardings: tuple | None = None
               ) -> tuple[TargetLayers, Any]:
    """Layer `lw` with q, k and v as one matrix, and its MLP `mw` (when dense) with gate and
    up as one: a decoding step's few rows then pass two matmuls where they passed five. At a
    few rows a matmul is bound by reading its weights, and one wide matmul reads them nearer
    the bandwidth than several narrow ones (benchmarks/decode_matmuls.py, docs/benchmarks.md).

    q's heads are grouped by the kv head they share (kv head k's G query heads, its key,
    its value), so a mesh that splits the heads over `tensor` splits the fused matrix at the
    same boundaries. `shardings`: (qkv's, gate_up's) `NamedSharding`, or None to let XLA
    place them."""
    d, n, h = lw.q.shape
    kv = lw.k.shape[1]
    qkv = jnp.concatenate([lw.q.reshape(d, kv, n // kv, h), lw.k[:, :, None],
                           lw.v[:, :, None]], axis=2)
    bias = None if lw.q_bias is None else jnp.concatenate(
        [lw.q_bias.reshape(kv, n // kv, h), lw.k_bias[:, None], lw.v_bias[:, None]], axis=1)
    if shardings and shardings[0] is not None:
        qkv = jax.lax.with_sharding_constraint(qkv, shardings[0])
    lw = dataclasses.replace(lw, q=None, k=None, v=None, q_bias=None, k_bias=None,
                             v_bias=None, qkv=qkv, qkv_bias=bias)
    if isinstance(mw, DenseMLP):
        gate_up = jnp.stack([mw.gate, mw.up], axis=1)
        if shardings and shardings[1] is not None:
            gate_up = jax.lax.with_sharding_constraint(gate_up, shardings[1])
        mw = DenseMLP(None, None, mw.down, gate_up)
    return lw, mw


def _fused_shardings(lw: TargetLayers, mw: Any) -> tuple | None:
    """`fuse_layer`'s output shardings from the split weights' own (k's heads, gate's ffw)."""
    def widen(a, at: int):
        if not isinstance(getattr(a, "sharding", None), NamedSharding):
            return None
        spec = tuple(a.sharding.spec) + (None,) * (a.ndim - len(a.sharding.spec))
        return NamedSharding(a.sharding.mesh, PartitionSpec(*spec[:at], None, *spec[at:]))

    out = (widen(lw.k, 2), widen(mw.gate, 1) if isinstance(mw, DenseMLP) else None)
    return out if any(out) else None


def layer_list(w: TargetWeights, cfg: TargetConfig, split, fuse=None) -> LayerList:
    """A `LayerList` from `split(stack) -> [one tree per index of the stack's leading axis]`,
    applied to the attention stack and to the dense and the expert MLP stacks, whose slices
    are put back in layer order (Qwen3-MoE mixes dense and sparse layers), then
    `fuse(layer, mlp)` of each layer (decoding's layout; None: as split, the trainer's)."""
    mlps = {False: split(w.mlp) if w.mlp is not None else [],
            True: split(w.experts) if w.experts is not None else []}
    counts = {True: 0, False: 0}
    ordered = []
    for sparse in _sparse_layers(cfg):
        ordered.append(mlps[sparse][counts[sparse]])
        counts[sparse] += 1
    mlps.clear()
    layers, fused_mlps = [], []
    for lw, mw in zip(split(w.layers), ordered, strict=True):
        if fuse is not None:
            lw, mw = fuse(lw, mw)
        layers.append(lw)
        fused_mlps.append(mw)
    return LayerList(w.embed, layers, fused_mlps, w.final_norm, w.lm_head)


def unstack(w: TargetWeights, cfg: TargetConfig, fuse: bool = True) -> LayerList:
    """Per-layer copies of the stacked weights, fused for decoding (`fuse_layer`) unless
    `fuse` is False (jit it, drop the stacked ones after).

    Holds both copies at once; `unstack_in_place` needs one stacked array's worth extra."""
    def split(stack) -> list:
        n = jax.tree.leaves(stack)[0].shape[0]
        return [jax.tree.map(lambda a, i=i: a[i], stack) for i in range(n)]

    return layer_list(w, cfg, split, fuse_layer if fuse else None)


# jitted once for the process: every load of a target (each run of a sweep or of the tests,
# every engine of an eval) reuses the programs compiled for its shapes
_split_one = jax.jit(lambda a: tuple(a[i] for i in range(a.shape[0])))
_fuse_one = jax.jit(fuse_layer, static_argnums=2)


def unstack_in_place(w: TargetWeights | LayerList, cfg: TargetConfig,
                     fuse: bool = True) -> LayerList:
    """`unstack`, one stacked array at a time, deleting each once it is split (and each
    layer's split weights once fused): the peak is the target plus its largest stacked
    array, not two targets (an MoE target's experts are most of it). `w` must not be used
    afterwards. A `LayerList` is returned as it is. `fuse`: decoding's layout (`fuse_layer`;
    the trainer, whose target forward runs thousands of rows a step, keeps the split one:
    there a fused matmul gains nothing it was measured for)."""
    if isinstance(w, LayerList):
        return w

    def split(stack) -> list:
        leaves, treedef = jax.tree.flatten(stack)
        parts = []
        for a in leaves:
            parts.append(_split_one(a))
            a.delete()
        return [treedef.unflatten([p[i] for p in parts]) for i in range(len(parts[0]))]

    def fuse_in_place(lw, mw):
        fused = _fuse_one(lw, mw, _fused_shardings(lw, mw))
        kept = {id(a) for a in jax.tree.leaves(fused)}
        for a in jax.tree.leaves((lw, mw)):
            if id(a) not in kept:
                a.delete()
        return fused

    return layer_list(w, cfg, split, fuse_in_place if fuse else None)


def loop_layers(w: LayerList, cfg: TargetConfig, tokens_BxT, positions_BxT, kv_fn,
                 aux_layer_ids: tuple[int, ...] = (), attn_impl: str = "xla") -> TargetOutput:
    """`_scan_layers` for per-layer weights: a Python loop, capturing the input of each
    layer in `aux_layer_ids` (concatenated in that order, as the scan's slots)."""
    _check_aux_ids(cfg, aux_layer_ids)
    tables = _tables(cfg)
    with jax.named_scope("embed"):
        x = _embed(w, cfg, tokens_BxT)
    captured = {}
    for i, (lw, mw, sparse) in enumerate(zip(w.layers, w.mlps, _sparse_layers(cfg),
                                             strict=True)):
        if i in aux_layer_ids:
            captured[i] = x
        with jax.named_scope(f"layer{i}"):
            x, _ = _layer(x, lw, cfg, positions_BxT, tables, kv_fn, _mlp_for(cfg, sparse), mw,
                          i, None, attn_impl)
    with jax.named_scope("final_norm"):
        x = (gemma_rms_norm if cfg.gemma_norms else rms_norm)(x, w.final_norm, cfg.rms_norm_eps)
    if not aux_layer_ids:
        return TargetOutput(x, None)
    aux_BxTxA = jnp.concatenate([captured[i] for i in aux_layer_ids], axis=-1)
    return TargetOutput(x, constrain(aux_BxTxA, ("batch", "seq", "act_embed")))
