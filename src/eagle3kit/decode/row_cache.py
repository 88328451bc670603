"""Decoding rows over a KV cache: the target's forward for the generation engine.

`RowCache` is the one cache layout of every decoder (plain and speculative generation,
`regenerate` and `eval`); `forward_rows` runs T new tokens per row through the target's
layers (`core.target.loop_layers`), each layer's attention being a `RowAttention` over the
cache, read through the XLA path or the ragged kernel (`decode/ragged_attention.py`), and a
few rows' matmuls through `decode/skinny_matmul.py` where it pays.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from eagle3kit.core.blocks import window_mask
from eagle3kit.core.config import TargetConfig
from eagle3kit.core.target import LayerAttention, LayerList, TargetOutput, attend_layer, loop_layers
from eagle3kit.decode import skinny_matmul
from eagle3kit.decode.ragged_attention import attend_rows


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class RowCache:
    """KV cache of C independent rows of S slots, one array pair per layer. Every decoder
    (plain and speculative generation, `regenerate` and `eval`) uses this one layout."""

    k: list  # L x [C,S,K,H]
    v: list

    @staticmethod
    def zeros(cfg: TargetConfig, rows: int, positions: int, dtype: Any) -> RowCache:
        shape = (rows, positions, cfg.num_kv_heads, cfg.head_dim)
        return RowCache([jnp.zeros(shape, dtype) for _ in range(cfg.num_layers)],
                        [jnp.zeros(shape, dtype) for _ in range(cfg.num_layers)])


@dataclasses.dataclass(frozen=True)
class RowAttention(LayerAttention):
    """The attention of `forward_rows` for one layer, the one place that reads the cache.

    Writes the new tokens' keys and values at slots prefix_B[b] + j of cache row rows_B[b],
    then lets query t of batch row b see the slots s < prefix_B[b] (slot index == RoPE
    position there) and the new tokens j where block_mask[b, t, j] (None: j <= t), inside the
    layer's sliding window measured in RoPE positions (new token j's is q_positions[b, j]).
    This is `decode/ragged_attention.attend_rows`'s contract: with `rows_impl="xla"` the path
    below reads the first `window` slots of the rows; with "pallas" the kernel reads each row
    in place up to its own length (a first prefill, which reads no cache, stays below).

    The XLA path slices the window when the batch is every cache row in order (`rows_B`
    None: decode and verify steps) and gathers it by `rows_B` only for a subset (prefill
    pieces): a gather copies every row's window out of the cache where a slice is read in
    place, and decode steps that gathered lost much of the speed of the slicing engine before
    them (docs/benchmarks.md).
    """

    cfg: TargetConfig
    ks: list  # per layer [C,S,K,H], updated in place (the caller's lists)
    vs: list
    rows_B: jax.Array | None  # None: batch row b is cache row b, every row (decode, verify)
    prefix_B: jax.Array
    q_positions_BxT: jax.Array
    block_mask_BxTxT: jax.Array | None
    window: int  # slots read (static): >= every prefix + T; 0: read none (a first prefill)
    attn_impl: str = "xla"
    rows_impl: str = "xla"  # how the cache is read: "xla" (the window) or "pallas" (in place)
    matmul_impl: str = "xla"  # a few rows' q|k|v, o_proj and down: XLA or decode/skinny_matmul

    def matmul(self, x_BxTxK: jax.Array, w_KxN: jax.Array) -> jax.Array:
        """x @ w: the Pallas kernel where it pays (matmul_impl "pallas":
        skinny_matmul.pays), else XLA's."""
        m = x_BxTxK.shape[0] * x_BxTxK.shape[1]
        if self.matmul_impl == "pallas" and skinny_matmul.pays(m, w_KxN, self.blocks):
            out = skinny_matmul.skinny_matmul(x_BxTxK.reshape(m, -1), w_KxN, self.blocks)
            return out.reshape(*x_BxTxK.shape[:2], -1)
        return jnp.einsum("btk,kn->btn", x_BxTxK, w_KxN)

    @property
    def blocks(self) -> skinny_matmul.SkinnyBlocks:
        return skinny_matmul.SkinnyBlocks(interpret=jax.default_backend() != "gpu")

    def __call__(self, q, k, v, layer: int, sinks):
        with jax.named_scope("cache_write"):
            self._write(k, v, layer)
        with jax.named_scope("attend"):
            return self._attend(q, k, v, layer, sinks)

    def _write(self, k, v, layer: int) -> None:
        ks, vs, rows = self.ks, self.vs, self.rows_B
        if rows is None:  # row b's keys into cache row b, on the device holding it
            # (an index scatter over rows split across devices all-gathers every row's keys
            # and slots to every device first: three collectives per layer and step). A
            # slice past the cache's end would be clamped, not dropped; the engine admits no
            # request whose answer and one step's writes do not fit its row (Engine.check).
            put = jax.vmap(lambda c, x, p: jax.lax.dynamic_update_slice(c, x, (p, 0, 0)))
            ks[layer] = put(ks[layer], k.astype(ks[layer].dtype), self.prefix_B)
            vs[layer] = put(vs[layer], v.astype(vs[layer].dtype), self.prefix_B)
        else:
            slots = self.prefix_B[:, None] + jnp.arange(k.shape[1])[None, :]
            ks[layer] = ks[layer].at[rows[:, None], slots].set(k.astype(ks[layer].dtype),
                                                               mode="drop")
            vs[layer] = vs[layer].at[rows[:, None], slots].set(v.astype(vs[layer].dtype),
                                                               mode="drop")

    def _attend(self, q, k, v, layer: int, sinks):
        b, t = self.q_positions_BxT.shape
        ks, vs = self.ks, self.vs
        block = self.block_mask_BxTxT
        if self.window and self.rows_impl != "xla":
            windows = self.cfg.layer_windows
            return attend_rows(q, ks[layer], vs[layer], self.rows_B, self.prefix_B,
                               self.q_positions_BxT, block_mask_BxTxT=block,
                               window=windows[layer] if any(windows) else 0,
                               scale=self.cfg.query_scale or self.cfg.head_dim ** -0.5,
                               softcap=self.cfg.attn_softcap, sinks_N=sinks, impl=self.rows_impl)
        if block is None:
            block = jnp.broadcast_to(jnp.tril(jnp.ones((t, t), bool)), (b, t, t))
        if self.window == 0:  # the new tokens start their rows: nothing cached to read
            keys, values, mask, key_positions = k, v, block, self.q_positions_BxT
        else:
            keys, values = ks[layer][:, : self.window], vs[layer][:, : self.window]
            if self.rows_B is not None:  # a subset of the rows (prefill pieces)
                keys, values = keys[self.rows_B], values[self.rows_B]
            rel = jnp.arange(self.window)[None, :] - self.prefix_B[:, None]  # B,W
            new = (rel >= 0) & (rel < t)
            j = jnp.clip(rel, 0, t - 1)
            sees_new = jnp.take_along_axis(block, jnp.broadcast_to(j[:, None], (b, t,
                                                                                self.window)),
                                           axis=2)
            mask = (rel < 0)[:, None, :] | (new[:, None, :] & sees_new)
            key_positions = jnp.where(new, jnp.take_along_axis(self.q_positions_BxT, j, 1),
                                      jnp.arange(self.window)[None, :])
        if any(self.cfg.layer_windows) and self.cfg.layer_windows[layer]:
            mask = window_mask(mask, self.q_positions_BxT, key_positions,
                               self.cfg.layer_windows[layer])
        return attend_layer(self.cfg, q, keys.astype(q.dtype), values.astype(q.dtype), mask, sinks,
                       self.attn_impl)


def forward_rows(w: LayerList, cfg: TargetConfig, tokens_BxT: jax.Array,
                 positions_BxT: jax.Array, cache: RowCache, *, rows_B: jax.Array | None = None,
                 prefix_B: jax.Array | None = None, block_mask_BxTxT: jax.Array | None = None,
                 window: int | None = None, prefill: bool = False,
                 aux_layer_ids: tuple[int, ...] = (), rows_impl: str = "xla",
                 matmul_impl: str | None = None) -> tuple[TargetOutput, RowCache]:
    """Forward of T new tokens per row, each row at its own positions (batched generation,
    speculative verification); returns the output (final-normed hidden [B,T,D], the captured
    states of `aux_layer_ids`) and the updated cache.

    Batch row b writes its keys at slots prefix_B[b] .. prefix_B[b]+T-1 of cache row
    rows_B[b] (default: row b, then B == C) and reads the row's slots below prefix_B[b],
    where slot index == RoPE position. `positions_BxT` are the new tokens' RoPE positions:
    prefix_B[b] + j for a plain run of tokens (the default prefix is positions_BxT[:, 0]),
    prefix + depth for a draft tree, whose `block_mask_BxTxT[b, t, j]` says which new tokens
    query t sees (its ancestors and itself; None: causal). See `RowAttention`.

    prefill  the T tokens start their rows (prefix 0): no cache is read; padding after a
             prompt writes keys past its end, which later tokens overwrite before any query
             can reach them.
    window   otherwise keys are read from the first `window` slots of the row (a static
             bound >= every prefix + T: decoding reads no more of the cache than the longest
             sequence needs).
    rows_impl  "xla" (that window: sliced, or gathered for `rows_B`) or "pallas"
             (decode/ragged_attention's kernel: each row read in place up to its own
             prefix + T; `window` is then unused).
    matmul_impl  how a step multiplies q|k|v, o_proj and down: "xla", or "pallas"
             (decode/skinny_matmul where it pays: a few rows, large weights); None: "pallas"
             where the cache kernel runs on a GPU (one device), else "xla".

    Writes past the cache's end are dropped.
    """
    prefix = positions_BxT[:, 0] if prefix_B is None else prefix_B
    window = 0 if prefill else cache.k[0].shape[1] if window is None else window
    ks, vs = list(cache.k), list(cache.v)
    if matmul_impl is None:
        matmul_impl = "pallas" if rows_impl == "pallas" and jax.default_backend() == "gpu" \
            else "xla"
    attention = RowAttention(cfg, ks, vs, rows_B, prefix, positions_BxT, block_mask_BxTxT,
                             window, rows_impl=rows_impl, matmul_impl=matmul_impl)
    out = loop_layers(w, cfg, tokens_BxT, positions_BxT, attention, aux_layer_ids)
    return out, RowCache(ks, vs)
