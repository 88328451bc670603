"""Per-layer variations of the target's attention and MLP that the newer families add.

Sliding windows (gpt-oss, Gemma-3) are a mask over (query position, key position), so any
`kv_fn` (training, cache decoding) gets them from the positions alone. Attention sinks
(gpt-oss), a query scale other than head_dim^-1/2 and score soft-capping (Gemma) change the
softmax, so they run the XLA attention here; plain layers keep `layers.attend` (cuDNN).

Shape letters as in `layers`: B batch, T query tokens, S key tokens, N query heads, K kv
heads, G = N // K, H head dim, D hidden, F MLP width.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from eagle3kit.core.layers import MASKED, swiglu
from eagle3kit.core.sharding import constrain


def window_mask(mask_BxTxS: jax.Array, q_positions_BxT: jax.Array,
                k_positions_BxS: jax.Array, window: jax.Array) -> jax.Array:
    """Keeps key s for query t only when pos(t) - pos(s) < window; `window` <= 0 = no window.

    `window` may be traced (one value per scanned layer), so local and global layers share
    one compiled layer.
    """
    near = (q_positions_BxT[:, :, None] - k_positions_BxS[:, None, :]) < window
    return mask_BxTxS & ((window <= 0) | near)


def attend_general(q_BxTxNxH: jax.Array, k_BxSxKxH: jax.Array, v_BxSxKxH: jax.Array,
                   mask_BxTxS: jax.Array, scale: float, softcap: float = 0.0,
                   sinks_N: jax.Array | None = None) -> jax.Array:
    """Masked softmax attention with a given scale, optional tanh soft cap on the scores and
    optional per-head sink logits (an extra softmax column whose value is dropped)."""
    b, t, n, h = q_BxTxNxH.shape
    kv = k_BxSxKxH.shape[2]
    q = q_BxTxNxH.reshape(b, t, kv, n // kv, h)
    s = jnp.einsum("btkgh,bskh->bkgts", q, k_BxSxKxH, preferred_element_type=jnp.float32)
    s = s * scale
    if softcap:
        s = jnp.tanh(s / softcap) * softcap
    s = jnp.where(mask_BxTxS[:, None, None], s, MASKED)
    if sinks_N is None:
        p = jax.nn.softmax(s, axis=-1)
    else:
        sink = sinks_N.astype(jnp.float32).reshape(1, kv, n // kv, 1, 1)
        m = jnp.maximum(s.max(axis=-1, keepdims=True), sink)
        e = jnp.exp(s - m)
        p = e / (e.sum(axis=-1, keepdims=True) + jnp.exp(sink - m))
    o = jnp.einsum("bkgts,bskh->btkgh", p.astype(v_BxSxKxH.dtype), v_BxSxKxH)
    return o.reshape(b, t, n, h)


def gemma_rms_norm(x: jax.Array, w: jax.Array, eps: float) -> jax.Array:
    """Gemma's RMSNorm: scale by (1 + w), all in fp32, then cast (the weight is stored as w)."""
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (y * (1.0 + w.astype(jnp.float32))).astype(x.dtype)


def gated_mlp(x_BxTxD: jax.Array, gate_DxF: jax.Array, up_DxF: jax.Array, down_FxD: jax.Array,
              activation: str, gate_up_Dx2xF: jax.Array | None = None,
              matmul=None) -> jax.Array:
    """down(act(gate(x)) * up(x)): SwiGLU (silu) or Gemma's GeGLU (tanh-approximate gelu).
    `gate_up_Dx2xF` (a decoding target's layers: target.fuse_layer) stands for gate and up,
    one matmul for both; `matmul(h, down)` (a decode step's) multiplies by down."""
    if gate_up_Dx2xF is None and matmul is None and activation == "silu":
        return swiglu(x_BxTxD, gate_DxF, up_DxF, down_FxD)
    with jax.named_scope("mlp"):
        if gate_up_Dx2xF is not None:
            gu = jnp.einsum("btd,dcf->btcf", x_BxTxD, gate_up_Dx2xF)
            g, u = gu[:, :, 0], gu[:, :, 1]
        else:
            g = jnp.einsum("btd,df->btf", x_BxTxD, gate_DxF)
            u = jnp.einsum("btd,df->btf", x_BxTxD, up_DxF)
        act = jax.nn.silu(g) if activation == "silu" else jax.nn.gelu(g, approximate=True)
        h = constrain(act * u, ("batch", "seq", "act_heads"))
        if matmul is not None:
            return matmul(h, down_FxD)
        return jnp.einsum("btf,fd->btd", h, down_FxD)
