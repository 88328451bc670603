"""P-EAGLE (parallel EAGLE): a draft that proposes a block of K tokens in one forward pass,
as speculators 0.9.0 (`speculators/models/peagle/`) and SpecForge 0.2.0
(`specforge/modeling/draft/peagle.py`) define it.

The head is EAGLE-3's (core/draft.py: fc over the captured target states, each RMS-normed
first with `fc_norm`; a first decoder layer whose attention reads the 2D-wide concat of the
normed embedding and the normed fused state, residual the un-normed fused state) followed by
`num_layers - 1` plain Llama decoder layers of width D, the final norm and its own lm_head.
Unlike EAGLE-3 it owns its token embedding (trained: speculators' `embed_requires_grad`,
initialised from the target's) and a learned `mask_hidden` [A], the captured state of a
position it has not seen.

One pass, for a row whose last committed column is (x_{n}, aux_{n-1}) at position p:

    column 0        embed(x_n),          fc(aux_{n-1})         position p
    column d = 1..K-1  embed(mask_token_id), fc(mask_hidden)    position p + d
    attention       column d sees the committed columns up to p and columns 0..d
    logits          lm_head(final_norm(h)) at column d: the draft for token n + 1 + d

Training samples such blocks from every anchor (COD sampling, `speculators.models.peagle.
data`) and trains each column against the target's distribution at its position (forward KL,
speculators' default). No hidden state is carried from one pass to the next, so EAGLE-3.1's
`norm_output` has no meaning here.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp

from eagle3kit.core import draft
from eagle3kit.core.arches import Key
from eagle3kit.core.config import DraftConfig
from eagle3kit.core.layers import attend, rms_norm, rope, swiglu
from eagle3kit.core.sharding import ArrayInfo, fan_in_init, normal_init, ones_init

MULTI_LAYER = True
MODEL_TYPE = "peagle"  # speculators_model_type and speculators_config.algorithm
ARCHITECTURE = "PEagleSpeculator"
DEFAULT_BLOCK = 8  # speculators' num_depths


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class PEagleWeights(draft.DraftWeights):
    """EAGLE-3's head (core/draft.DraftWeights: fc, the first layer, the final norm and
    lm_head), the token embedding, `mask_hidden`, and the later layers stacked on a leading
    axis L - 1 (None for a one-layer head)."""

    embed: Any = None  # V,D
    mask_hidden: Any = None  # 1,1,A (speculators' shape)
    layers_input_norm: Any = None  # L-1,D
    layers_q: Any = None  # L-1,D,N,H
    layers_k: Any = None  # L-1,D,K,H
    layers_v: Any = None  # L-1,D,K,H
    layers_o: Any = None  # L-1,N,H,D
    layers_post_attn_norm: Any = None  # L-1,D
    layers_gate: Any = None  # L-1,D,F
    layers_up: Any = None  # L-1,D,F
    layers_down: Any = None  # L-1,F,D

    @staticmethod
    def abstract(cfg: DraftConfig, dtype: Any = jnp.float32) -> PEagleWeights:
        head = draft.DraftWeights.abstract(cfg, dtype)
        D, F, N, K, H = (cfg.hidden_size, cfg.intermediate_size, cfg.num_heads,
                         cfg.num_kv_heads, cfg.head_dim)
        A = len(cfg.aux_layer_ids) * cfg.target_hidden_size

        def info(shape, init):
            return ArrayInfo(tuple(shape), dtype, ("draft",) * len(shape), init)

        extra = {}
        if cfg.num_layers > 1:
            L, lin = cfg.num_layers - 1, _stacked(1)
            extra = dict(
                layers_input_norm=info((L, D), ones_init), layers_q=info((L, D, N, H), lin),
                layers_k=info((L, D, K, H), lin), layers_v=info((L, D, K, H), lin),
                layers_o=info((L, N, H, D), _stacked(2)),
                layers_post_attn_norm=info((L, D), ones_init),
                layers_gate=info((L, D, F), lin), layers_up=info((L, D, F), lin),
                layers_down=info((L, F, D), lin))
        return PEagleWeights(**vars(head), embed=info((cfg.vocab_size, D), normal_init(0.02)),
                             mask_hidden=info((1, 1, A), normal_init(1.0)), **extra)


def _stacked(fan_in_dims: int):
    """torch.nn.Linear's init of each layer of a stack (axis 0 is the layer)."""
    def init(key, shape, dtype):
        keys = jax.random.split(key, shape[0])
        return jnp.stack([fan_in_init(fan_in_dims)(k, shape[1:], dtype) for k in keys])
    return init

Weights = PEagleWeights


def block_inputs(w: PEagleWeights, cfg: DraftConfig, tokens_BxT: jax.Array,
                 aux_BxTxA: jax.Array, real_BxT: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(embeddings [B,T,D], fused states g [B,T,D]) of the columns: a real column reads its
    token and captured states, a mask column `mask_token_id` and `mask_hidden`."""
    ids = jnp.where(real_BxT, tokens_BxT, cfg.mask_token_id)
    embeds = jnp.take(w.embed, ids, axis=0)
    aux = jnp.where(real_BxT[..., None], aux_BxTxA.astype(w.fc.dtype),
                    w.mask_hidden.astype(w.fc.dtype))
    return embeds, draft.fuse(w, cfg, aux)


def _layer(w: PEagleWeights, cfg: DraftConfig, i: int, x_BxTxD: jax.Array,
           positions_BxT: jax.Array, mask_BxTxS: jax.Array) -> jax.Array:
    """Later layer i (0-based among the stacked ones): a plain Llama decoder layer."""
    eps, inv_freq = cfg.rms_norm_eps, jnp.asarray(cfg.rope.inv_freq(cfg.head_dim))
    h = rms_norm(x_BxTxD, w.layers_input_norm[i], eps)
    q = rope(jnp.einsum("btd,dnh->btnh", h, w.layers_q[i]), positions_BxT, inv_freq)
    k = rope(jnp.einsum("btd,dkh->btkh", h, w.layers_k[i]), positions_BxT, inv_freq)
    v = jnp.einsum("btd,dkh->btkh", h, w.layers_v[i])
    x = x_BxTxD + jnp.einsum("btnh,nhd->btd", attend(q, k, v, mask_BxTxS), w.layers_o[i])
    return x + swiglu(rms_norm(x, w.layers_post_attn_norm[i], eps), w.layers_gate[i],
                      w.layers_up[i], w.layers_down[i])


def forward(w: PEagleWeights, cfg: DraftConfig, tokens_BxT: jax.Array, aux_BxTxA: jax.Array,
            real_BxT: jax.Array, positions_BxT: jax.Array, mask_BxTxT: jax.Array) -> jax.Array:
    """Draft logits [B, T, Vd] of every column in one pass; `mask` [B, T, T] says which
    columns a column attends to (the block mask of the module docstring)."""
    embeds, g = block_inputs(w, cfg, tokens_BxT, aux_BxTxA, real_BxT)
    h, _ = draft.step(w, dataclasses.replace(cfg, norm_output=False), embeds, g,
                      positions_BxT, draft.masked(mask_BxTxT))
    for i in range(cfg.num_layers - 1):
        h = _layer(w, cfg, i, h, positions_BxT, mask_BxTxT)
    return draft.head(w, dataclasses.replace(cfg, norm_output=False), h)


def block_mask(anchor_T: jax.Array, depth_T: jax.Array, segment_T: jax.Array) -> jax.Array:
    """[T, T]: speculators' `create_peagle_mask_mod`: a column sees the depth-0 columns of
    its document up to its anchor, and the columns of its own block up to its depth."""
    same_doc = segment_T[anchor_T][:, None] == segment_T[anchor_T][None, :]
    live = (segment_T[anchor_T] > 0)[:, None]
    context = (depth_T == 0)[None, :] & (anchor_T[:, None] >= anchor_T[None, :])
    own = (anchor_T[:, None] == anchor_T[None, :]) & (depth_T[:, None] >= depth_T[None, :])
    return live & same_doc & (context | own)


# ---- the registry's entry points (core/arches.py) -----------------------------------------

_LAYER_KEYS = (("input_layernorm.weight", "input_norm", 0), ("self_attn.q_proj.weight", "q", 1),
               ("self_attn.k_proj.weight", "k", 1), ("self_attn.v_proj.weight", "v", 1),
               ("self_attn.o_proj.weight", "o", 2),
               ("post_attention_layernorm.weight", "post_attn_norm", 0),
               ("mlp.gate_proj.weight", "gate", 1), ("mlp.up_proj.weight", "up", 1),
               ("mlp.down_proj.weight", "down", 1))


def export_keys(fmt: str, cfg: DraftConfig) -> tuple[Key, ...] | None:
    """speculators' PEagleDraftModel state dict: EAGLE-3's tensors under `layers.0.`, the
    later layers under `layers.{i}.`, `embed_tokens.weight` and `mask_hidden`. No other
    engine format holds a P-EAGLE draft."""
    if fmt != "speculators":
        return None
    keys = draft.key_table("layers.0.") + draft.fc_norm_keys(cfg)
    keys += (Key("embed_tokens.weight", "embed", 0), Key("mask_hidden", "mask_hidden", 0))
    for i in range(cfg.num_layers - 1):
        keys += tuple(Key(f"layers.{i + 1}.{name}", f"layers_{field}", n_in, i)
                      for name, field, n_in in _LAYER_KEYS)
    return keys


def export_fields(fmt: str, cfg: DraftConfig) -> dict[str, Any]:
    return {"speculators_model_type": MODEL_TYPE, "architectures": [ARCHITECTURE],
            "fc_norm": cfg.fc_norm, "norm_output": False, "mask_token_id": cfg.mask_token_id,
            "embed_requires_grad": True}


def read_flags(fmt: str, config: dict[str, Any]) -> dict[str, Any] | None:
    if fmt != "speculators" or config.get("speculators_model_type") != MODEL_TYPE:
        return None
    methods = (config.get("speculators_config") or {}).get("proposal_methods") or [{}]
    return {"method": "peagle", "fc_norm": bool(config.get("fc_norm", False)),
            "mask_token_id": config.get("mask_token_id"),
            "block_size": int(methods[0].get("speculative_tokens") or DEFAULT_BLOCK)}


def num_params(cfg: DraftConfig) -> int:
    return sum(math.prod(i.shape) for i in jax.tree.leaves(
        PEagleWeights.abstract(cfg), is_leaf=lambda x: isinstance(x, ArrayInfo)))
