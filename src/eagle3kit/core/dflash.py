"""DFlash: a block-diffusion draft that proposes a whole block of tokens in one forward pass.

The definition is the one speculators 0.9.0 (`models/dflash`) and SpecForge 0.2.0
(`modeling/draft/dflash.py`) share. A block of L = `block_size` query tokens

    block  = [anchor, mask, mask, ..., mask]      anchor: the last verified token (at position p)
    x_0    = embed(block)                          the target's (frozen) embedding, [L, D]

runs through `num_layers` Qwen3 decoder layers whose attention also reads the target:

    ctx    = hidden_norm(fc(concat(aux states)))   one [D] vector per verified position < p
    q      = rope(q_norm(x W_q))                   at the block's positions p .. p+L-1
    keys   = [rope(k_norm(ctx W_k)) ; rope(k_norm(x W_k))]    context first, then the block
    values = [ctx W_v ; x W_v]
    x      = x + o(attn(q, keys, values))          non-causal inside the block, every
    x      = x + mlp(post_attn_norm(x))            context position < p visible
    logits = lm_head(norm(x))                      slot i > 0 proposes the token at p + i

The context keys come from the same fc output in every layer (not from the draft's own
residual stream), and the input norm applies to the block only. The head is the target's
head restricted to the draft vocabulary, frozen (speculators freezes it, SpecForge calls the
target's own). The training forward (core/dflash_train.py) runs many blocks at once, one per
sampled anchor, each seeing the context before its anchor; decoding keeps the context keys of
every layer in a cache and proposes L - 1 tokens per pass.

Shapes: B rows, Q query tokens (blocks x L), S context positions, D hidden, A = C x target
hidden (C captured layers), N/K heads, H head dim, Vd draft vocab, L block size, Y layers.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from eagle3kit.core.arches import Key
from eagle3kit.core.config import DraftConfig
from eagle3kit.core.layers import MASKED, rms_norm, rope, swiglu
from eagle3kit.core.sharding import ArrayInfo, fan_in_init, init_weights, ones_init
from eagle3kit.errors import UserError


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class DFlashWeights:
    """Linear layers stored (in, out); per-layer weights stacked on a leading Y axis."""

    fc: Any  # A,D
    hidden_norm: Any  # D
    input_norm: Any  # Y,D
    q: Any  # Y,D,N,H
    k: Any  # Y,D,K,H
    v: Any  # Y,D,K,H
    o: Any  # Y,N,H,D
    q_norm: Any  # Y,H
    k_norm: Any  # Y,H
    post_attn_norm: Any  # Y,D
    gate: Any  # Y,D,F
    up: Any  # Y,D,F
    down: Any  # Y,F,D
    final_norm: Any  # D
    # D,Vd: a reduced draft vocab's frozen copy of the target's head (speculators keeps one);
    # None over the full vocab, where the head is the target's own (`head_weight`)
    lm_head: Any = None

    @staticmethod
    def abstract(cfg: DraftConfig, dtype: Any = jnp.float32) -> DFlashWeights:
        """`ArrayInfo` of every weight; replicated (logical axis `draft`)."""
        D, F, N, K, H, Y = (cfg.hidden_size, cfg.intermediate_size, cfg.num_heads,
                            cfg.num_kv_heads, cfg.head_dim, cfg.num_layers)
        A = len(cfg.aux_layer_ids) * cfg.target_hidden_size

        def info(shape, init):
            return ArrayInfo(tuple(shape), dtype, ("draft",) * len(shape), init)

        def stacked(shape, fan_in_dims):
            inner = fan_in_init(fan_in_dims)
            return info((Y, *shape), lambda key, s, d: _per_layer(inner, key, s, d))

        return DFlashWeights(
            fc=info((A, D), fan_in_init(1)),
            hidden_norm=info((D,), ones_init),
            input_norm=info((Y, D), ones_init),
            q=stacked((D, N, H), 1),
            k=stacked((D, K, H), 1),
            v=stacked((D, K, H), 1),
            o=stacked((N, H, D), 2),
            q_norm=info((Y, H), ones_init),
            k_norm=info((Y, H), ones_init),
            post_attn_norm=info((Y, D), ones_init),
            gate=stacked((D, F), 1),
            up=stacked((D, F), 1),
            down=stacked((F, D), 1),
            final_norm=info((D,), ones_init),
            lm_head=(None if cfg.draft_vocab_size == cfg.vocab_size
                     else info((D, cfg.draft_vocab_size), fan_in_init(1))),
        )


def _per_layer(init, key, shape, dtype):
    """`init` over each layer's slice, the fan-in read from the per-layer shape."""
    keys = jax.random.split(key, shape[0])
    return jnp.stack([init(k, shape[1:], dtype) for k in keys])


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Layer:
    """One decoder layer's weights (a slice of `DFlashWeights` at layer y)."""

    input_norm: Any
    q: Any
    k: Any
    v: Any
    o: Any
    q_norm: Any
    k_norm: Any
    post_attn_norm: Any
    gate: Any
    up: Any
    down: Any


def layer(w: DFlashWeights, y: int) -> Layer:
    return Layer(*(getattr(w, f.name)[y] for f in dataclasses.fields(Layer)))


def context(w: DFlashWeights, cfg: DraftConfig, aux_BxSxA: jax.Array) -> jax.Array:
    """ctx = hidden_norm(fc(captured states)) -> [B, S, D]: what every layer's keys read."""
    with jax.named_scope("dflash_context"):
        g = jnp.einsum("bsa,ad->bsd", aux_BxSxA.astype(w.fc.dtype), w.fc)
        return rms_norm(g, w.hidden_norm, cfg.rms_norm_eps)


def context_kv(lw: Layer, cfg: DraftConfig, ctx_BxSxD: jax.Array, positions_BxS: jax.Array
               ) -> tuple[jax.Array, jax.Array]:
    """One layer's keys and values of context positions -> ([B,S,K,H], [B,S,K,H]): what the
    decoder caches (they do not depend on the block)."""
    inv_freq = jnp.asarray(cfg.rope.inv_freq(cfg.head_dim))
    k = rms_norm(jnp.einsum("bsd,dkh->bskh", ctx_BxSxD, lw.k), lw.k_norm, cfg.rms_norm_eps)
    return rope(k, positions_BxS, inv_freq), jnp.einsum("bsd,dkh->bskh", ctx_BxSxD, lw.v)


def block_attention(q_BxQxNxH: jax.Array, k_BxQxKxH: jax.Array, v_BxQxKxH: jax.Array,
                    ctx_k_BxSxKxH: jax.Array, ctx_v_BxSxKxH: jax.Array, ctx_mask_BxQxS: jax.Array,
                    block_size: int) -> jax.Array:
    """Each block token over its visible context keys and its own block's L keys, one
    softmax -> [B, Q, N, H]. The block keys are scored per block ([P, L, L]), never against
    all Q block tokens."""
    b, q_len, n, h = q_BxQxNxH.shape
    kh, p = k_BxQxKxH.shape[2], q_len // block_size
    qg = q_BxQxNxH.reshape(b, q_len, kh, n // kh, h)
    s_ctx = jnp.einsum("bqkgh,bskh->bkgqs", qg, ctx_k_BxSxKxH.astype(qg.dtype),
                       preferred_element_type=jnp.float32) * (h ** -0.5)
    s_ctx = jnp.where(ctx_mask_BxQxS[:, None, None], s_ctx, MASKED)
    qb = qg.reshape(b, p, block_size, kh, n // kh, h)
    kb = k_BxQxKxH.reshape(b, p, block_size, kh, h)
    s_blk = jnp.einsum("bplkgh,bpmkh->bkgplm", qb, kb,
                       preferred_element_type=jnp.float32) * (h ** -0.5)
    s_blk = s_blk.reshape(b, kh, n // kh, q_len, block_size)
    probs = jax.nn.softmax(jnp.concatenate([s_ctx, s_blk], axis=-1), axis=-1)
    dtype = v_BxQxKxH.dtype
    p_ctx = probs[..., :-block_size].astype(dtype)
    p_blk = probs[..., -block_size:].astype(dtype).reshape(b, kh, n // kh, p, block_size,
                                                          block_size)
    o = jnp.einsum("bkgqs,bskh->bqkgh", p_ctx, ctx_v_BxSxKxH.astype(dtype))
    o = o + jnp.einsum("bkgplm,bpmkh->bplkgh", p_blk,
                       v_BxQxKxH.reshape(b, p, block_size, kh, h)).reshape(o.shape)
    return o.reshape(b, q_len, n, h)


def block_layer(lw: Layer, cfg: DraftConfig, x_BxQxD: jax.Array, positions_BxQ: jax.Array,
                ctx_k_BxSxKxH: jax.Array, ctx_v_BxSxKxH: jax.Array, ctx_mask_BxQxS: jax.Array
                ) -> jax.Array:
    """One decoder layer over the block tokens (attention, then the MLP) -> [B, Q, D]."""
    eps = cfg.rms_norm_eps
    inv_freq = jnp.asarray(cfg.rope.inv_freq(cfg.head_dim))
    h = rms_norm(x_BxQxD, lw.input_norm, eps)
    q = rope(rms_norm(jnp.einsum("bqd,dnh->bqnh", h, lw.q), lw.q_norm, eps), positions_BxQ,
             inv_freq)
    k = rope(rms_norm(jnp.einsum("bqd,dkh->bqkh", h, lw.k), lw.k_norm, eps), positions_BxQ,
             inv_freq)
    v = jnp.einsum("bqd,dkh->bqkh", h, lw.v)
    a = block_attention(q, k, v, ctx_k_BxSxKxH, ctx_v_BxSxKxH, ctx_mask_BxQxS, cfg.block_size)
    x = x_BxQxD + jnp.einsum("bqnh,nhd->bqd", a, lw.o)
    return x + swiglu(rms_norm(x, lw.post_attn_norm, eps), lw.gate, lw.up, lw.down)


def forward(w: DFlashWeights, cfg: DraftConfig, block_embeds_BxQxD: jax.Array,
            positions_BxQ: jax.Array, ctx_kv: list[tuple[jax.Array, jax.Array]],
            ctx_mask_BxQxS: jax.Array) -> jax.Array:
    """All layers over Q block tokens (Q / `cfg.block_size` whole blocks) -> the normed hidden
    [B, Q, D]. `ctx_kv[y]` are layer y's context keys and values (`context_kv`), `ctx_mask`
    which context positions each block token sees."""
    x = block_embeds_BxQxD.astype(w.fc.dtype)
    for y in range(cfg.num_layers):
        with jax.named_scope(f"dflash_layer{y}"):
            k, v = ctx_kv[y]
            x = block_layer(layer(w, y), cfg, x, positions_BxQ, k, v, ctx_mask_BxQxS)
    return rms_norm(x, w.final_norm, cfg.rms_norm_eps)


def all_context_kv(w: DFlashWeights, cfg: DraftConfig, ctx_BxSxD: jax.Array,
                   positions_BxS: jax.Array) -> list[tuple[jax.Array, jax.Array]]:
    """`context_kv` of every layer."""
    return [context_kv(layer(w, y), cfg, ctx_BxSxD, positions_BxS)
            for y in range(cfg.num_layers)]


def head_weight(w: DFlashWeights, target_w: Any, draft_to_target_Vd: jax.Array) -> jax.Array:
    """The frozen head [D, Vd]: the draft's copy, or the target's columns of the draft ids."""
    if w.lm_head is not None:
        return w.lm_head
    from eagle3kit.core.target import lm_head_weight
    return jnp.take(lm_head_weight(target_w), draft_to_target_Vd, axis=1)


def head(head_DxVd: jax.Array, h_BxQxD: jax.Array) -> jax.Array:
    """Draft logits [B, Q, Vd] through the frozen head (no gradient reaches it)."""
    return jnp.einsum("bqd,dv->bqv", h_BxQxD,
                      jax.lax.stop_gradient(head_DxVd).astype(h_BxQxD.dtype))


def cast(w: DFlashWeights, dtype: Any) -> DFlashWeights:
    return jax.tree.map(lambda x: x.astype(dtype), w)


# ---- the method's registry entry points (core/arches.py) ----------------------------------

Weights = DFlashWeights
MULTI_LAYER = True


def _layer_keys(y: int) -> tuple[Key, ...]:
    p = f"layers.{y}."
    a, m = f"{p}self_attn.", f"{p}mlp."
    return (
        Key(f"{p}input_layernorm.weight", "input_norm", 0, y),
        Key(f"{a}q_proj.weight", "q", 1, y),
        Key(f"{a}k_proj.weight", "k", 1, y),
        Key(f"{a}v_proj.weight", "v", 1, y),
        Key(f"{a}o_proj.weight", "o", 2, y),
        Key(f"{a}q_norm.weight", "q_norm", 0, y),
        Key(f"{a}k_norm.weight", "k_norm", 0, y),
        Key(f"{p}post_attention_layernorm.weight", "post_attn_norm", 0, y),
        Key(f"{m}gate_proj.weight", "gate", 1, y),
        Key(f"{m}up_proj.weight", "up", 1, y),
        Key(f"{m}down_proj.weight", "down", 1, y),
    )


def export_keys(fmt: str, cfg: DraftConfig) -> tuple[Key, ...] | None:
    """speculators' and SGLang's DFlash tensors (the same names). Neither stores a head that
    is the target's own: speculators writes `lm_head.weight` only for a reduced draft
    vocabulary (its frozen copy of the target's rows), SGLang always projects through the
    target's head, so it cannot express a reduced vocabulary."""
    full_vocab = cfg.draft_vocab_size == cfg.vocab_size
    if fmt not in ("speculators", "sglang") or (fmt == "sglang" and not full_vocab):
        return None
    keys = (Key("fc.weight", "fc", 1), Key("hidden_norm.weight", "hidden_norm", 0))
    for y in range(cfg.num_layers):
        keys += _layer_keys(y)
    keys += (Key("norm.weight", "final_norm", 0),)
    return keys if full_vocab else keys + (Key("lm_head.weight", "lm_head", 1),)


def export_fields(fmt: str, cfg: DraftConfig) -> dict[str, Any]:
    return {}


def read_flags(fmt: str, config: dict[str, Any]) -> dict[str, Any] | None:
    """A DFlash config of either engine (formats/dflash.py reads the rest of it)."""
    if fmt == "speculators":
        return {"method": "dflash"} if config.get("speculators_model_type") == "dflash" else None
    if fmt == "sglang" and "speculators_model_type" not in config and (
            "dflash_config" in config or "DFlashDraftModel" in (config.get("architectures") or ())):
        return {"method": "dflash"}
    return None


def num_params(cfg: DraftConfig) -> int:
    """Trained parameters (the frozen head not counted)."""
    d, f, y = cfg.hidden_size, cfg.intermediate_size, cfg.num_layers
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    a = len(cfg.aux_layer_ids) * cfg.target_hidden_size
    per_layer = 2 * d * q + 2 * d * kv + 3 * d * f + 2 * d + 2 * cfg.head_dim
    return a * d + 2 * d + y * per_layer


# ---- what the trainer calls (core/trainer.py), implemented in core/dflash_train.py ---------

def configure(cfg: DraftConfig, target_hf: dict[str, Any], train: Any) -> DraftConfig:
    """A new draft's shape from `train`'s options (jobs/config.TrainConfig): --draft-layers,
    --block-size and --mask-token-id, by default the target's last vocabulary id."""
    mask = cfg.vocab_size - 1 if train.mask_token_id is None else train.mask_token_id
    if mask >= cfg.vocab_size:
        raise UserError(f"--mask-token-id {mask} is outside the target's vocabulary of "
                        f"{cfg.vocab_size}")
    return dataclasses.replace(cfg, num_layers=train.draft_layers, block_size=train.block_size,
                               mask_token_id=mask)


def metric_steps(cfg: DraftConfig) -> int:
    """Predicted slots per block: the K of the acceptance metrics."""
    return cfg.block_size - 1


def initial_weights(cfg: DraftConfig, key: jax.Array, target_w: Any, vocab: Any,
                    mesh: Any = None) -> DFlashWeights:
    """A fresh draft; a reduced vocab's head copied from the target's over the draft vocab
    (`vocab`: VocabArrays), as speculators copies it from the verifier."""
    w = init_weights(DFlashWeights.abstract(cfg), key, mesh)
    if w.lm_head is not None:
        w.lm_head = head_weight(dataclasses.replace(w, lm_head=None), target_w,
                                vocab.draft_to_target).astype(jnp.float32)
    return w


# loss_fn and loss_denominators: the trainer imports this module on first use (named.imported)
# rather than this one importing it, since the training forward builds on this module
TRAINING = "eagle3kit.core.dflash_train"
