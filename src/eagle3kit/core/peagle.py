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

from eagle3kit.core import draft, losses
from eagle3kit.core import ttt as ttt_lib
from eagle3kit.core.arches import Key
from eagle3kit.core.config import DraftConfig
from eagle3kit.core.layers import attend, rms_norm, rope, swiglu
from eagle3kit.core.metrics import step_counts
from eagle3kit.core.sharding import ArrayInfo, fan_in_init, init_weights, normal_init, ones_init

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


def later_qkv(w: PEagleWeights, cfg: DraftConfig, i: int, x_BxTxD: jax.Array,
               positions_BxT: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """q, k, v of later layer i (0-based among the stacked ones), a plain Llama layer."""
    inv_freq = jnp.asarray(cfg.rope.inv_freq(cfg.head_dim))
    h = rms_norm(x_BxTxD, w.layers_input_norm[i], cfg.rms_norm_eps)
    q = rope(jnp.einsum("btd,dnh->btnh", h, w.layers_q[i]), positions_BxT, inv_freq)
    k = rope(jnp.einsum("btd,dkh->btkh", h, w.layers_k[i]), positions_BxT, inv_freq)
    return q, k, jnp.einsum("btd,dkh->btkh", h, w.layers_v[i])


def later_finish(w: PEagleWeights, cfg: DraftConfig, i: int, x_BxTxD: jax.Array,
                  attn_BxTxNxH: jax.Array) -> jax.Array:
    x = x_BxTxD + jnp.einsum("btnh,nhd->btd", attn_BxTxNxH, w.layers_o[i])
    return x + swiglu(rms_norm(x, w.layers_post_attn_norm[i], cfg.rms_norm_eps),
                      w.layers_gate[i], w.layers_up[i], w.layers_down[i])


def head_config(cfg: DraftConfig) -> DraftConfig:
    """No state is carried between passes: the head always norms (norm_output off)."""
    return dataclasses.replace(cfg, norm_output=False)


def forward(w: PEagleWeights, cfg: DraftConfig, tokens_BxT: jax.Array, aux_BxTxA: jax.Array,
            real_BxT: jax.Array, positions_BxT: jax.Array, mask_BxTxT: jax.Array) -> jax.Array:
    """Draft logits [B, T, Vd] of every column in one pass; `mask` [B, T, T] says which
    columns a column attends to (the block mask of the module docstring)."""
    embeds, g = block_inputs(w, cfg, tokens_BxT, aux_BxTxA, real_BxT)
    h, _ = draft.step(w, head_config(cfg), embeds, g, positions_BxT, draft.masked(mask_BxTxT))
    for i in range(cfg.num_layers - 1):
        q, k, v = later_qkv(w, cfg, i, h, positions_BxT)
        h = later_finish(w, cfg, i, h, attend(q, k, v, mask_BxTxT))
    return draft.head(w, head_config(cfg), h)


def block_mask(anchor_T: jax.Array, depth_T: jax.Array, segment_T: jax.Array) -> jax.Array:
    """[T, T]: speculators' `create_peagle_mask_mod`: a column sees the depth-0 columns of
    its document up to its anchor, and the columns of its own block up to its depth."""
    same_doc = segment_T[anchor_T][:, None] == segment_T[anchor_T][None, :]
    live = (segment_T[anchor_T] > 0)[:, None]
    context = (depth_T == 0)[None, :] & (anchor_T[:, None] >= anchor_T[None, :])
    own = (anchor_T[:, None] == anchor_T[None, :]) & (depth_T[:, None] >= depth_T[None, :])
    return live & same_doc & (context | own)


# ---- training (core/trainer.py calls `loss_fn` for this method) ------------------------------

# speculators' COD sampling keeps a fraction max(r**d, r_min) of the anchors at depth d
# (down_sample_ratio 0.7, down_sample_ratio_min 0.2) and averages the loss over every sampled
# column. Here every anchor runs at every depth and depth d weighs that fraction: the same
# loss in expectation, without a random, shape-changing subset.
COD_RATIO, COD_RATIO_MIN = 0.7, 0.2


def depth_weights(steps: int) -> list[float]:
    return [max(COD_RATIO ** d, COD_RATIO_MIN) for d in range(steps)]


def block_logits(w: PEagleWeights, cfg: DraftConfig, sig: Any, batch: Any,
                 ttt_cfg: Any) -> list[jax.Array]:
    """Logits [B, T, Vd] of every depth d < K = `ttt_cfg.steps` of the blocks anchored at
    every column t of the packed rows, in one pass. Column (t, d) sits where TTT's step d of
    column t does (input x[t+1] and aux[t] at d = 0, the mask token and `mask_hidden` after;
    position positions[t] + d) and attends to the same keys (the depth-0 columns up to t in
    its document, and its own block up to d), so TTT's blockwise attention serves."""
    K, head_cfg = ttt_cfg.steps, head_config(cfg)
    emb0 = jnp.take(w.embed, ttt_lib.shift(batch.tokens, 1), axis=0)
    g0 = draft.fuse(w, cfg, sig.aux_BxTxA.astype(w.fc.dtype))
    emb_mask = jnp.broadcast_to(w.embed[cfg.mask_token_id], emb0.shape)
    g_mask = jnp.broadcast_to(draft.fuse(w, cfg, w.mask_hidden), g0.shape)
    positions = [batch.positions + d for d in range(K)]

    def attention(qs, ks, vs):
        impl = "pallas" if ttt_cfg.attention == "pallas" else "xla"
        return [ttt_lib.attend_across_steps(qs[d], list(ks[:d + 1]), list(vs[:d + 1]),
                                            batch.segment_ids, ttt_cfg.attention_block, impl,
                                            ttt_cfg.flash_blocks) for d in range(K)]

    with jax.named_scope("peagle_layer0"):
        ps = [draft.project(w, head_cfg, emb0 if d == 0 else emb_mask, g0 if d == 0 else g_mask,
                            positions[d]) for d in range(K)]
        outs = attention([p.q_BxTxNxH for p in ps], [p.k_BxTxKxH for p in ps],
                         [p.v_BxTxKxH for p in ps])
        hs = [draft.finish(w, head_cfg, a, p.residual_BxTxD)
              for a, p in zip(outs, ps, strict=True)]
    for i in range(cfg.num_layers - 1):
        with jax.named_scope(f"peagle_layer{i + 1}"):
            qkv = [later_qkv(w, cfg, i, hs[d], positions[d]) for d in range(K)]
            outs = attention(*zip(*qkv, strict=True))
            hs = [later_finish(w, cfg, i, h, a) for h, a in zip(hs, outs, strict=True)]
    return [draft.head(w, head_cfg, h) for h in hs]


def rollout(w: PEagleWeights, cfg: DraftConfig, sig: Any, batch: Any, vocab: Any, ttt_cfg: Any,
            denominators_K: jax.Array) -> tuple[jax.Array, Any]:
    """The loss of every block (`block_logits`; depth d's target is p[t+1+d]) -> (loss,
    counts per depth)."""
    K = ttt_cfg.steps
    w = draft.cast(w, ttt_cfg.compute_dtype)
    valid = ttt_lib.valid_masks(batch, K)
    all_logits = block_logits(w, cfg, sig, batch, ttt_cfg)
    trained, ces, corrects = [], [], []
    for d in range(K):
        with jax.named_scope(f"peagle_loss{d}"):
            logits = all_logits[d]
            train = valid[d] & ttt_lib.shift(sig.in_draft_BxT, 1 + d)
            p_d = ttt_lib.shift(sig.probs_BxTxVd, 1 + d)
            ce = losses.soft_cross_entropy(logits, p_d) * train
            trained.append(ce if ttt_cfg.loss == "kl"
                           else losses.per_position_loss(ttt_cfg.loss, logits, p_d) * train)
            ces.append(ce)
            predicted = vocab.draft_to_target[jnp.argmax(logits, axis=-1)]
            corrects.append(valid[d] & (predicted == ttt_lib.shift(sig.argmax_BxT, 1 + d)))
    weights = depth_weights(K)
    total = sum(wd * t.sum() for wd, t in zip(weights, trained, strict=True))
    count = sum(wd * n for wd, n in zip(weights, denominators_K, strict=True))
    return total / jnp.maximum(count, 1.0), step_counts(valid, corrects, ces)


def loss_fn(params: PEagleWeights, target_w: Any, batch: Any, vocab: Any,
            denominators_K: jax.Array, *, tcfg: Any, dcfg: DraftConfig, ttt: Any
            ) -> tuple[jax.Array, Any]:
    """Target forward (frozen) + every block's pass: what the trainer differentiates."""
    sig = ttt_lib.target_signals(target_w, tcfg, dcfg, vocab, batch, ttt.attention)
    return rollout(params, dcfg, sig, batch, vocab, ttt, denominators_K)


def configure(cfg: DraftConfig, target_hf: dict[str, Any], train: Any) -> DraftConfig:
    """The block a new draft proposes (`train --ttt-length`) and its mask token: the target's
    pad token, else its last vocabulary id (a padding row in most vocabularies); the draft
    owns and trains its embedding, so the row only has to be the same at decoding."""
    mask = cfg.mask_token_id
    if mask is None:
        pad = target_hf.get("pad_token_id")
        mask = int(pad) if pad is not None else cfg.vocab_size - 1
    return dataclasses.replace(cfg, block_size=train.ttt.steps, mask_token_id=mask,
                               norm_output=False)


def initial_weights(cfg: DraftConfig, key: jax.Array, target_w: Any, vocab: Any, mesh: Any
                    ) -> PEagleWeights:
    """A new draft's weights: random, the embedding the target's (speculators copies the
    verifier's embedding into the draft before training)."""
    w = init_weights(PEagleWeights.abstract(cfg), key, mesh)
    return dataclasses.replace(w, embed=jnp.asarray(target_w.embed, jnp.float32))


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
