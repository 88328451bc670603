"""The EAGLE3 draft head: fc fusion, one Llama decoder layer of width 2H, lm head over Vd.

One step, for a column t (shapes below per batch row):

    g      = fc(concat(aux states))                     (first step; later steps: previous h)
    x      = concat(input_norm(embed(token)), hidden_norm(g))             [T, 2D]
    h      = g + o_proj(attn(q(x), k(x), v(x)))         (residual is the un-normed g)
    h      = h + mlp(post_attn_norm(h))                 pre-norm output: the next step's input
    logits = lm_head(final_norm(h))                     over the Vd draft tokens

EAGLE-3.1 (`DraftConfig.fc_norm`, `norm_output`, as speculators and vLLM read them):

    g      = fc(concat(fc_norm_i(aux state i)))         an RMSNorm per captured state
    h      = final_norm(h)                              the *post-norm* state is carried to the
    logits = lm_head(h)                                 next step, and the head reads it as is

`step` is the one draft step every caller runs (the trainer's TTT rollout, the chain and tree
decoders); only its attention differs (across TTT steps, over a KV cache, over a tree), so the
caller passes that as a function of the projected q, k, v.

This module is the method "eagle3" of the architecture registry (core/arches.py): EAGLE3,
EAGLE-3.1 and EAGLE-3.1-fc are its flags. Its export mapping (`export_keys`, `export_fields`,
`read_flags`) says, per engine format, which tensor holds which weight and which config
fields carry the flags.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from eagle3kit.core.arches import Key
from eagle3kit.core.config import DraftConfig
from eagle3kit.core.layers import attend, rms_norm, rope, swiglu
from eagle3kit.core.sharding import ArrayInfo, fan_in_init, ones_init


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class DraftWeights:
    """Trainable draft weights, linear layers stored (in, out). A = 3 * target hidden."""

    fc: Any  # A,D
    hidden_norm: Any  # D
    input_norm: Any  # D
    q: Any  # 2D,N,H
    k: Any  # 2D,K,H
    v: Any  # 2D,K,H
    o: Any  # N,H,D
    post_attn_norm: Any  # D
    gate: Any  # D,F
    up: Any  # D,F
    down: Any  # F,D
    final_norm: Any  # D
    lm_head: Any  # D,Vd
    fc_norm: Any = None  # C,Ht: EAGLE-3.1's norm of each of the C captured states (else None)

    @staticmethod
    def abstract(cfg: DraftConfig, dtype: Any = jnp.float32) -> DraftWeights:
        """`ArrayInfo` of every weight; the draft is replicated (logical axis `draft`)."""
        D, F, N, K, H = (cfg.hidden_size, cfg.intermediate_size, cfg.num_heads,
                         cfg.num_kv_heads, cfg.head_dim)
        C = len(cfg.aux_layer_ids)
        A = C * cfg.target_hidden_size

        def info(shape, init):
            return ArrayInfo(tuple(shape), dtype, ("draft",) * len(shape), init)

        lin = fan_in_init(1)
        return DraftWeights(
            fc=info((A, D), lin),
            hidden_norm=info((D,), ones_init),
            input_norm=info((D,), ones_init),
            q=info((2 * D, N, H), lin),
            k=info((2 * D, K, H), lin),
            v=info((2 * D, K, H), lin),
            o=info((N, H, D), fan_in_init(2)),
            post_attn_norm=info((D,), ones_init),
            gate=info((D, F), lin),
            up=info((D, F), lin),
            down=info((F, D), lin),
            final_norm=info((D,), ones_init),
            lm_head=info((D, cfg.draft_vocab_size), lin),
            fc_norm=info((C, cfg.target_hidden_size), ones_init) if cfg.fc_norm else None,
        )


def arrays(w: DraftWeights) -> dict[str, Any]:
    """The weights `w` has, by field name (an EAGLE3 draft has no `fc_norm`)."""
    return {f.name: getattr(w, f.name) for f in dataclasses.fields(w)
            if getattr(w, f.name) is not None}


def fuse(w: DraftWeights, cfg: DraftConfig, aux_BxTxA: jax.Array) -> jax.Array:
    """g = fc(concat of the captured target states, each normed first with fc_norm) -> [B,T,D]."""
    with jax.named_scope("fc"):
        aux = aux_BxTxA.astype(w.fc.dtype)
        if w.fc_norm is not None:
            b, t, _ = aux.shape
            aux = rms_norm(aux.reshape(b, t, *w.fc_norm.shape), w.fc_norm,
                           cfg.rms_norm_eps).reshape(b, t, -1)
        return jnp.einsum("bta,ad->btd", aux, w.fc)


@dataclasses.dataclass(frozen=True)
class Projected:
    q_BxTxNxH: jax.Array
    k_BxTxKxH: jax.Array
    v_BxTxKxH: jax.Array
    residual_BxTxD: jax.Array


def project(w: DraftWeights, cfg: DraftConfig, embeds_BxTxD: jax.Array, hidden_BxTxD: jax.Array,
            positions_BxT: jax.Array) -> Projected:
    """Norms, the 2D-wide concat, q/k/v and RoPE at `positions`."""
    with jax.named_scope("draft_qkv"):
        e = rms_norm(embeds_BxTxD.astype(w.input_norm.dtype), w.input_norm, cfg.rms_norm_eps)
        hn = rms_norm(hidden_BxTxD, w.hidden_norm, cfg.rms_norm_eps)
        residual = hn if cfg.norm_before_residual else hidden_BxTxD
        x = jnp.concatenate([e, hn], axis=-1)
        inv_freq = jnp.asarray(cfg.rope.inv_freq(cfg.head_dim))
        q = rope(jnp.einsum("bte,enh->btnh", x, w.q), positions_BxT, inv_freq)
        k = rope(jnp.einsum("bte,ekh->btkh", x, w.k), positions_BxT, inv_freq)
        v = jnp.einsum("bte,ekh->btkh", x, w.v)
        return Projected(q, k, v, residual)


def finish(w: DraftWeights, cfg: DraftConfig, attn_BxTxNxH: jax.Array,
           residual_BxTxD: jax.Array) -> jax.Array:
    """o_proj + residual, then the MLP block -> the carried hidden h [B, T, D]: pre-norm, or
    post-norm with `norm_output`."""
    with jax.named_scope("draft_mlp"):
        h = residual_BxTxD + jnp.einsum("btnh,nhd->btd", attn_BxTxNxH, w.o)
        h = h + swiglu(rms_norm(h, w.post_attn_norm, cfg.rms_norm_eps), w.gate, w.up, w.down)
        return rms_norm(h, w.final_norm, cfg.rms_norm_eps) if cfg.norm_output else h


def head(w: DraftWeights, cfg: DraftConfig, h_BxTxD: jax.Array) -> jax.Array:
    """Draft logits over the draft vocabulary [B, T, Vd] from the carried hidden of `finish`
    (normed here unless `norm_output` already normed it)."""
    with jax.named_scope("draft_head"):
        x = h_BxTxD if cfg.norm_output else rms_norm(h_BxTxD, w.final_norm, cfg.rms_norm_eps)
        return jnp.einsum("btd,dv->btv", x, w.lm_head)


# attention(projected) -> (attention output [B, T, N, H], anything the caller keeps, e.g. a cache)
Attention = Callable[[Projected], tuple[jax.Array, Any]]


def step(w: DraftWeights, cfg: DraftConfig, embeds_BxTxD: jax.Array, hidden_BxTxD: jax.Array,
         positions_BxT: jax.Array, attention: Attention) -> tuple[jax.Array, Any]:
    """One draft step -> (carried hidden h [B, T, D], what `attention` returned beside its output).

    `hidden` is the fused g (first step) or the previous step's h; `head(h)` gives the logits.
    The step's keys and values reach the caller through `attention` (it sees `Projected`).
    """
    p = project(w, cfg, embeds_BxTxD, hidden_BxTxD, positions_BxT)
    a, kept = attention(p)
    return finish(w, cfg, a, p.residual_BxTxD), kept


def masked(mask_BxTxS: jax.Array) -> Attention:
    """Plain self-attention of the step's own columns under `mask` (no cache)."""
    return lambda p: (attend(p.q_BxTxNxH, p.k_BxTxKxH, p.v_BxTxKxH, mask_BxTxS), None)


def cast(w: DraftWeights, dtype: Any) -> DraftWeights:
    """The compute copy of the (fp32 master) weights."""
    return jax.tree.map(lambda x: x.astype(dtype), w)


# ---- the method's registry entry points (core/arches.py) ----------------------------------

Weights = DraftWeights

# The prefix of the decoder layer in each engine format this method is written in.
_LAYER = {"sglang": "midlayer.", "speculators": "layers.0."}


def key_table(layer: str) -> tuple[Key, ...]:
    """The thirteen tensors both engines load, in the order engines write them; `layer` is
    the prefix of the decoder layer (`midlayer.` or `layers.0.`)."""
    attn, mlp = f"{layer}self_attn.", f"{layer}mlp."
    return (
        Key("fc.weight", "fc", 1),
        Key(f"{layer}hidden_norm.weight", "hidden_norm", 0),
        Key(f"{layer}input_layernorm.weight", "input_norm", 0),
        Key(f"{attn}q_proj.weight", "q", 1),
        Key(f"{attn}k_proj.weight", "k", 1),
        Key(f"{attn}v_proj.weight", "v", 1),
        Key(f"{attn}o_proj.weight", "o", 2),
        Key(f"{layer}post_attention_layernorm.weight", "post_attn_norm", 0),
        Key(f"{mlp}gate_proj.weight", "gate", 1),
        Key(f"{mlp}up_proj.weight", "up", 1),
        Key(f"{mlp}down_proj.weight", "down", 1),
        Key("norm.weight", "final_norm", 0),
        Key("lm_head.weight", "lm_head", 1),
    )


def fc_norm_keys(cfg: DraftConfig) -> tuple[Key, ...]:
    """EAGLE-3.1's per-state norms `fc_norm.{i}.weight` (SpecForge's, SGLang's and
    speculators' name alike) when the draft has them."""
    if not cfg.fc_norm:
        return ()
    return tuple(Key(f"fc_norm.{i}.weight", "fc_norm", 0, i)
                 for i in range(len(cfg.aux_layer_ids)))


def export_keys(fmt: str, cfg: DraftConfig) -> tuple[Key, ...] | None:
    layer = _LAYER.get(fmt)
    return None if layer is None else key_table(layer) + fc_norm_keys(cfg)


def export_fields(fmt: str, cfg: DraftConfig) -> dict[str, Any]:
    """EAGLE-3.1's flags as each engine reads them: speculators and vLLM always read both;
    SGLang's midlayer format writes them only when true, since SpecForge 0.2.0's training
    code read an absent `norm_output` in another sense (formats/sglang.py)."""
    flags = {"fc_norm": cfg.fc_norm, "norm_output": cfg.norm_output}
    if fmt == "sglang":
        return {k: True for k, on in flags.items() if on}
    return flags


def read_flags(fmt: str, config: dict[str, Any]) -> dict[str, Any] | None:
    """The flags of an engine config of this method (None: the config is another method's),
    read where and as that engine reads them."""
    if fmt == "speculators" and config.get("speculators_model_type") != "eagle3":
        return None
    fc_norm = config.get("fc_norm") or (fmt == "sglang" and config.get("use_aux_norm"))
    return {"method": "eagle3", "fc_norm": bool(fc_norm),
            "norm_output": bool(config.get("norm_output", False))}
