"""The target model in pure JAX: Llama / Qwen2 / Qwen3 forward with hidden-state capture.

Layers are stacked along a leading `layers` axis and run under `lax.scan`, so an 8B target
compiles as one layer. The scan captures the residual stream entering the configured layers
(HF `hidden_states[i]`), which the EAGLE3 draft reads, and optionally reads/writes a KV cache
for decoding.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from eagle3kit.core.config import TargetConfig
from eagle3kit.core.layers import attend, causal_mask, rms_norm, rope, swiglu
from eagle3kit.core.sharding import ArrayInfo, constrain, fan_in_init, normal_init, ones_init


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class TargetLayers:
    """Decoder layers stacked on axis 0 (L). Linear weights are stored (in, out)."""

    attn_norm: Any  # L,D
    q: Any  # L,D,N,H
    k: Any  # L,D,K,H
    v: Any  # L,D,K,H
    o: Any  # L,N,H,D
    mlp_norm: Any  # L,D
    gate: Any  # L,D,F
    up: Any  # L,D,F
    down: Any  # L,F,D
    q_bias: Any = None  # L,N,H (Qwen2)
    k_bias: Any = None  # L,K,H
    v_bias: Any = None  # L,K,H
    q_norm: Any = None  # L,H (Qwen3)
    k_norm: Any = None  # L,H


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class TargetWeights:
    embed: Any  # V,D
    layers: TargetLayers
    final_norm: Any  # D
    lm_head: Any = None  # D,V; None when tied to `embed`

    @staticmethod
    def abstract(cfg: TargetConfig, dtype: Any = jnp.bfloat16) -> TargetWeights:
        """`ArrayInfo` for every weight of `cfg` (nothing allocated)."""
        L, D, F = cfg.num_layers, cfg.hidden_size, cfg.intermediate_size
        N, K, H, V = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.vocab_size

        def info(shape, axes, init=None):
            return ArrayInfo(tuple(shape), dtype, tuple(axes), init or fan_in_init(2))

        lin = fan_in_init(2)  # fan-in is the D (or N*H) dimension after the layer axis
        norm = ones_init
        layers = TargetLayers(
            attn_norm=info((L, D), ("layers", "embed"), norm),
            q=info((L, D, N, H), ("layers", "embed", "heads", "head_dim"), lin),
            k=info((L, D, K, H), ("layers", "embed", "kv_heads", "head_dim"), lin),
            v=info((L, D, K, H), ("layers", "embed", "kv_heads", "head_dim"), lin),
            o=info((L, N, H, D), ("layers", "heads", "head_dim", "embed"), fan_in_init(3)),
            mlp_norm=info((L, D), ("layers", "embed"), norm),
            gate=info((L, D, F), ("layers", "embed", "ffw"), lin),
            up=info((L, D, F), ("layers", "embed", "ffw"), lin),
            down=info((L, F, D), ("layers", "ffw", "embed"), lin),
        )
        if cfg.attention_bias:
            layers.q_bias = info((L, N, H), ("layers", "heads", "head_dim"), normal_init())
            layers.k_bias = info((L, K, H), ("layers", "kv_heads", "head_dim"), normal_init())
            layers.v_bias = info((L, K, H), ("layers", "kv_heads", "head_dim"), normal_init())
        if cfg.qk_norm:
            layers.q_norm = info((L, H), ("layers", "head_dim"), norm)
            layers.k_norm = info((L, H), ("layers", "head_dim"), norm)
        return TargetWeights(
            embed=info((V, D), ("vocab", "embed"), normal_init()),
            layers=layers,
            final_norm=info((D,), ("embed",), norm),
            lm_head=None if cfg.tie_word_embeddings else info((D, V), ("embed", "vocab"),
                                                              normal_init()),
        )


def lm_head_weight(w: TargetWeights) -> jax.Array:
    """[D, V]: the untied head, or the embedding transposed when tied."""
    return w.embed.T if w.lm_head is None else w.lm_head


def embed_tokens(w: TargetWeights, tokens_BxT: jax.Array) -> jax.Array:
    return constrain(jnp.take(w.embed, tokens_BxT, axis=0), ("batch", "seq", "act_embed"))


def _layer(x_BxTxD, lw: TargetLayers, cfg: TargetConfig, positions_BxT, inv_freq, kv_fn,
           layer, extra, attn_impl: str = "xla"):
    """One decoder layer (index `layer`).

    `kv_fn(k, v, layer, extra) -> (k_all, v_all, mask, extra)` supplies the keys to attend to:
    the layer's own (training) or a KV cache it updates (decoding).
    """
    with jax.named_scope("attention"):
        h = rms_norm(x_BxTxD, lw.attn_norm, cfg.rms_norm_eps)
        q = jnp.einsum("btd,dnh->btnh", h, lw.q)
        k = jnp.einsum("btd,dkh->btkh", h, lw.k)
        v = jnp.einsum("btd,dkh->btkh", h, lw.v)
        if lw.q_bias is not None:
            q, k, v = q + lw.q_bias, k + lw.k_bias, v + lw.v_bias
        if lw.q_norm is not None:
            q = rms_norm(q, lw.q_norm, cfg.rms_norm_eps)
            k = rms_norm(k, lw.k_norm, cfg.rms_norm_eps)
        q = constrain(rope(q, positions_BxT, inv_freq), ("batch", "seq", "act_heads", None))
        k = constrain(rope(k, positions_BxT, inv_freq), ("batch", "seq", "act_heads", None))
        v = constrain(v, ("batch", "seq", "act_heads", None))
        k_all, v_all, mask, extra = kv_fn(k, v, layer, extra)
        a = attend(q, k_all, v_all, mask, attn_impl)
        x_BxTxD = x_BxTxD + jnp.einsum("btnh,nhd->btd", a, lw.o)
    h = rms_norm(x_BxTxD, lw.mlp_norm, cfg.rms_norm_eps)
    x_BxTxD = x_BxTxD + swiglu(h, lw.gate, lw.up, lw.down)
    return constrain(x_BxTxD, ("batch", "seq", "act_embed")), extra


@dataclasses.dataclass(frozen=True)
class TargetOutput:
    hidden_BxTxD: jax.Array  # final-normed hidden state (input of the lm head)
    aux_BxTxA: jax.Array | None  # captured states concatenated, A = len(aux_layer_ids) * D;
    # None when no layer is captured (`aux_layer_ids=()`, plain generation)


def _capture_slots(cfg: TargetConfig, unique_ids: tuple[int, ...]) -> jax.Array:
    """slot[layer] = position of that layer in `unique_ids`, or len(ids) (a scratch slot)."""
    slots = [len(unique_ids)] * cfg.num_layers
    for j, i in enumerate(unique_ids):
        if not 0 <= i < cfg.num_layers:
            raise ValueError(f"aux layer id {i} outside 0..{cfg.num_layers - 1}")
        slots[i] = j
    return jnp.asarray(slots, jnp.int32)


def _scan_layers(w: TargetWeights, cfg: TargetConfig, tokens_BxT, positions_BxT,
                 aux_layer_ids, kv_fn, extra, attn_impl: str = "xla"):
    """Runs the stacked layers, writing the input of each captured layer into its slot.

    Capturing costs one [B,T,D] write per layer (uncaptured layers write a scratch slot)
    instead of keeping every layer's output.
    """
    inv_freq = jnp.asarray(cfg.rope.inv_freq(cfg.head_dim))
    unique = tuple(sorted(set(aux_layer_ids)))
    slots = _capture_slots(cfg, unique)
    n = len(unique)
    x = embed_tokens(w, tokens_BxT)
    b, t, d = x.shape
    # no capture asked (plain generation): no aux buffer and no per-layer write at all
    aux = jnp.zeros((n + 1, b, t, d), x.dtype) if n else None

    def body(carry, xs):
        x, aux, extra = carry
        lw, layer = xs
        if n:
            aux = jax.lax.dynamic_update_slice(aux, x[None], (slots[layer], 0, 0, 0))
        x, extra = _layer(x, lw, cfg, positions_BxT, inv_freq, kv_fn, layer, extra, attn_impl)
        return (x, aux, extra), None

    (x, aux, extra), _ = jax.lax.scan(body, (x, aux, extra),
                                      (w.layers, jnp.arange(cfg.num_layers)))
    x = rms_norm(x, w.final_norm, cfg.rms_norm_eps)
    if not n:
        return TargetOutput(x, None), extra
    order = [unique.index(i) for i in aux_layer_ids]  # ids may repeat on tiny models
    aux_BxTxA = jnp.moveaxis(aux[jnp.asarray(order)], 0, 2).reshape(b, t, len(order) * d)
    return TargetOutput(x, constrain(aux_BxTxA, ("batch", "seq", "act_embed"))), extra


def forward(w: TargetWeights, cfg: TargetConfig, tokens_BxT: jax.Array,
            segment_ids_BxT: jax.Array | None = None, positions_BxT: jax.Array | None = None,
            aux_layer_ids: tuple[int, ...] | None = None, attn_impl: str = "xla"
            ) -> TargetOutput:
    """Full-sequence forward (training, teacher-forced eval).

    `segment_ids` (0 = padding) keep packed documents apart; `positions` restart per document.
    Returns the final-normed hidden state and the captured auxiliary states.
    `attn_impl`: "xla" or "cudnn" (see layers.attend).
    """
    aux_layer_ids = cfg.default_aux_layer_ids() if aux_layer_ids is None else aux_layer_ids
    b, t = tokens_BxT.shape
    if segment_ids_BxT is None:
        segment_ids_BxT = jnp.ones((b, t), jnp.int32)
    if positions_BxT is None:
        positions_BxT = jnp.broadcast_to(jnp.arange(t), (b, t))
    mask = causal_mask(segment_ids_BxT)

    def kv_fn(k, v, layer, extra):
        return k, v, mask, extra

    out, _ = _scan_layers(w, cfg, tokens_BxT, positions_BxT, aux_layer_ids, kv_fn, None,
                          attn_impl)
    return out


def logits(w: TargetWeights, hidden_BxTxD: jax.Array) -> jax.Array:
    """[B, T, V] logits from the final-normed hidden state."""
    out = jnp.einsum("btd,dv->btv", hidden_BxTxD, lm_head_weight(w))
    return constrain(out, ("batch", "seq", "act_vocab"))


# ---- KV-cache decoding ---------------------------------------------------------------------


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class KVCache:
    k: jax.Array  # L,B,S,K,H
    v: jax.Array  # L,B,S,K,H

    @staticmethod
    def zeros(cfg: TargetConfig, batch: int, max_len: int, dtype: Any) -> KVCache:
        shape = (cfg.num_layers, batch, max_len, cfg.num_kv_heads, cfg.head_dim)
        return KVCache(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype))


def forward_cached(w: TargetWeights, cfg: TargetConfig, tokens_BxT: jax.Array,
                   start: jax.Array, cache: KVCache,
                   aux_layer_ids: tuple[int, ...] | None = None
                   ) -> tuple[TargetOutput, KVCache]:
    """Forward of T new tokens at cache positions start..start+T-1 (same for every row).

    Keys beyond each query's own position are masked, so stale entries left by rejected
    speculative tokens are never read; they are overwritten by the next call.
    """
    aux_layer_ids = cfg.default_aux_layer_ids() if aux_layer_ids is None else aux_layer_ids
    b, t = tokens_BxT.shape
    max_len = cache.k.shape[2]
    positions = jnp.broadcast_to(start + jnp.arange(t), (b, t))
    mask = jnp.broadcast_to(jnp.arange(max_len)[None, :] <= positions[0][:, None],
                            (b, t, max_len))

    def kv_fn(k, v, layer, extra):
        ck, cv = extra
        ck = jax.lax.dynamic_update_slice(ck, k[None], (layer, 0, start, 0, 0))
        cv = jax.lax.dynamic_update_slice(cv, v[None], (layer, 0, start, 0, 0))
        return ck[layer], cv[layer], mask, (ck, cv)

    out, (k, v) = _scan_layers(w, cfg, tokens_BxT, positions, aux_layer_ids, kv_fn,
                               (cache.k, cache.v))
    return out, KVCache(k, v)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class LayerList:
    """A target with its layers unstacked, for decoding.

    Scanning stacked layers makes XLA copy each layer's weights (and cache) out of the stack
    at every step: at batch sizes where decoding is bound by reading the weights once, that
    doubles the traffic. Decoding therefore loops over per-layer arrays instead (one compiled
    body per layer, which the small decode programs can afford).
    """

    embed: Any  # V,D
    layers: list  # [TargetLayers], one per layer
    final_norm: Any
    lm_head: Any = None


def unstack(w: TargetWeights) -> LayerList:
    """Per-layer copies of the stacked weights (jit it; drop the stacked ones after)."""
    n = w.layers.attn_norm.shape[0]
    return LayerList(w.embed, [jax.tree.map(lambda a, i=i: a[i], w.layers) for i in range(n)],
                     w.final_norm, w.lm_head)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class RowCache:
    """KV cache of C independent rows of S positions, one array pair per layer."""

    k: list  # L x [C,S,K,H]
    v: list

    @staticmethod
    def zeros(cfg: TargetConfig, rows: int, positions: int, dtype: Any) -> RowCache:
        shape = (rows, positions, cfg.num_kv_heads, cfg.head_dim)
        return RowCache([jnp.zeros(shape, dtype) for _ in range(cfg.num_layers)],
                        [jnp.zeros(shape, dtype) for _ in range(cfg.num_layers)])


def forward_rows(w: LayerList, cfg: TargetConfig, tokens_BxT: jax.Array,
                 positions_BxT: jax.Array, cache: RowCache, *, rows_B: jax.Array | None = None,
                 window: int | None = None, prefill: bool = False
                 ) -> tuple[jax.Array, RowCache]:
    """Forward of T new tokens per row, each row at its own positions (batched generation);
    returns the final-normed hidden state [B,T,D] and the updated cache.

    Row r of the cache holds S positions; a position's keys live at that index of its row,
    so each row has its own RoPE positions and length. Batch row b writes its keys at
    `positions_BxT[b]` of cache row `rows_B[b]` (default: row b, then B == C) and attends to
    the keys at positions <= its own.

    prefill  the T tokens start a sequence at position 0: they attend to each other only
             (causally), so no cache is read; padding after a prompt writes keys past its
             end, which later tokens overwrite before any query can reach them.
    window   otherwise keys are read from the first `window` positions of the row (a
             static bound >= every query position + 1: decoding reads no more of the
             cache than the longest sequence needs).

    Writes past the cache's end are dropped.
    """
    b, t = tokens_BxT.shape
    rows = jnp.arange(b) if rows_B is None else rows_B
    window = cache.k[0].shape[1] if window is None else window
    if prefill:
        mask = jnp.broadcast_to(jnp.tril(jnp.ones((t, t), bool)), (b, t, t))
    else:
        mask = jnp.arange(window)[None, None, :] <= positions_BxT[:, :, None]
    ks, vs = list(cache.k), list(cache.v)

    def kv_fn(k, v, layer, extra):
        ks[layer] = ks[layer].at[rows[:, None], positions_BxT].set(k.astype(ks[layer].dtype),
                                                                   mode="drop")
        vs[layer] = vs[layer].at[rows[:, None], positions_BxT].set(v.astype(vs[layer].dtype),
                                                                   mode="drop")
        if prefill:
            return k, v, mask, extra
        keys, values = ks[layer][:, :window], vs[layer][:, :window]
        if rows_B is not None:
            keys, values = keys[rows], values[rows]
        return keys, values, mask, extra

    inv_freq = jnp.asarray(cfg.rope.inv_freq(cfg.head_dim))
    x = embed_tokens(w, tokens_BxT)
    for i, lw in enumerate(w.layers):
        with jax.named_scope(f"layer{i}"):
            x, _ = _layer(x, lw, cfg, positions_BxT, inv_freq, kv_fn, i, None)
    return rms_norm(x, w.final_norm, cfg.rms_norm_eps), RowCache(ks, vs)
