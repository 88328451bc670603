"""Building blocks shared by the target model and the draft head.

Shape letters: B batch, T query tokens, S key tokens, D hidden, F MLP width, N query heads,
K key/value heads, G = N // K query heads per kv head, H head dim.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from eagle3kit.core.sharding import constrain

# Finite "minus infinity", the one score every attention here gives what a row cannot see:
# a fully masked row (padding) gives a uniform softmax, not NaN, and in the blockwise kernels
# (flash.py, decode/ragged_attention.py) a key block a row cannot see weighs exp2(-huge) = 0.
MASKED = -1e30


def rms_norm(x: jax.Array, w: jax.Array, eps: float) -> jax.Array:
    """RMSNorm as transformers computes it: statistics in fp32, then cast, then scale."""
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return w * y.astype(x.dtype)


def rope(x_BxTxNxH: jax.Array, positions_BxT: jax.Array, inv_freq: jax.Array) -> jax.Array:
    """Rotary embedding, non-interleaved halves (HF `rotate_half`), angles in fp32."""
    angles = positions_BxT.astype(jnp.float32)[..., None] * inv_freq  # B,T,H/2
    angles = jnp.concatenate([angles, angles], axis=-1)[:, :, None, :]
    cos, sin = jnp.cos(angles).astype(x_BxTxNxH.dtype), jnp.sin(angles).astype(x_BxTxNxH.dtype)
    half = x_BxTxNxH.shape[-1] // 2
    rotated = jnp.concatenate([-x_BxTxNxH[..., half:], x_BxTxNxH[..., :half]], axis=-1)
    return x_BxTxNxH * cos + rotated * sin


def attention_scores(q_BxTxNxH: jax.Array, k_BxSxKxH: jax.Array) -> jax.Array:
    """Scaled scores [B, K, G, T, S] in fp32 (grouped-query: G query heads per kv head)."""
    b, t, n, h = q_BxTxNxH.shape
    kv = k_BxSxKxH.shape[2]
    q = q_BxTxNxH.reshape(b, t, kv, n // kv, h)
    s = jnp.einsum("btkgh,bskh->bkgts", q, k_BxSxKxH, preferred_element_type=jnp.float32)
    return s * (h ** -0.5)


def attend(q_BxTxNxH: jax.Array, k_BxSxKxH: jax.Array, v_BxSxKxH: jax.Array,
           mask_BxTxS: jax.Array, impl: str = "xla") -> jax.Array:
    """Masked softmax attention -> [B, T, N, H].

    `impl="cudnn"` runs cuDNN's fused flash attention (GPU, bf16/fp16): the [B,N,T,S] scores
    are never written to memory, which dominates the target's cost at T=2048. When T == S the
    mask must be causal (key s visible only if s <= t, as every caller's is): cuDNN is told so
    and skips the tiles above the diagonal instead of computing and masking them.
    """
    if impl == "cudnn":
        causal = q_BxTxNxH.shape[1] == k_BxSxKxH.shape[1]
        return jax.nn.dot_product_attention(q_BxTxNxH, k_BxSxKxH, v_BxSxKxH,
                                            mask=mask_BxTxS[:, None], is_causal=causal,
                                            implementation="cudnn")
    s = attention_scores(q_BxTxNxH, k_BxSxKxH)
    s = jnp.where(mask_BxTxS[:, None, None], s, MASKED)
    p = jax.nn.softmax(s, axis=-1).astype(v_BxSxKxH.dtype)
    o = jnp.einsum("bkgts,bskh->btkgh", p, v_BxSxKxH)
    b, t = q_BxTxNxH.shape[:2]
    return o.reshape(b, t, *q_BxTxNxH.shape[2:])


def causal_mask(segment_ids_BxT: jax.Array) -> jax.Array:
    """[B, T, T]: key s is visible to query t when s <= t in the same segment.

    Packed documents carry different segment ids, so attention never crosses a document.
    Padding (segment 0) attends only to padding; every row sees at least its own key, so no
    softmax row is empty (an empty row is NaN in fused kernels, and 0 * NaN poisons sums).
    """
    t = segment_ids_BxT.shape[1]
    causal = jnp.arange(t)[None, :] <= jnp.arange(t)[:, None]
    same = segment_ids_BxT[:, :, None] == segment_ids_BxT[:, None, :]
    return causal[None] & same


def swiglu(x_BxTxD: jax.Array, gate_DxF: jax.Array, up_DxF: jax.Array,
           down_FxD: jax.Array) -> jax.Array:
    """Llama MLP: down(silu(gate(x)) * up(x))."""
    with jax.named_scope("mlp"):
        g = jnp.einsum("btd,df->btf", x_BxTxD, gate_DxF)
        u = jnp.einsum("btd,df->btf", x_BxTxD, up_DxF)
        h = constrain(jax.nn.silu(g) * u, ("batch", "seq", "act_heads"))
        return jnp.einsum("btf,fd->btd", h, down_FxD)
