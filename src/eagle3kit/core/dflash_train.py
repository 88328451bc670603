"""DFlash training: random anchors, one block per anchor, all blocks in one forward pass.

As speculators 0.9.0 trains it (`DFlashDraftModel._backbone_forward`, `select_anchors`,
`compute_metrics`), per packed row of T tokens:

    anchors   `anchors` positions drawn uniformly without replacement among the trained
              tokens (loss mask 1) that are not in the row's last L positions; a row with
              fewer such tokens has invalid (padding) anchors
    block a   tokens [x[a], mask, ..., mask] at positions pos[a] .. pos[a] + L - 1; it sees
              the context (fc of the captured states) at packed columns < a of its own
              document, and its own block both ways (core/dflash.py)
    slot i    (1 <= i < L) predicts x[a + i]: its target is the target's distribution at column
              a + i - 1 over the draft vocab (soft), trained where loss_mask[a + i] is 1, a + i
              is in a's document (speculators does not check that; eagle3kit never trains
              across documents) and the anchor is valid
    loss      sum_i sum_a w_i * l(a, i) / n, w_i = exp(-(i - 1) / gamma) (speculators'
              `fixed-exp-decay`, gamma = 4 by default), l the per-position loss (`--loss`,
              KL by default as speculators), n the count of trained slots

Slot i plays the part of TTT step k = i - 1 in the metrics (`StepCounts`): acc_k is the
share of slot k + 1's predictions equal to the target's argmax, cond_acc_k the same among
blocks whose earlier slots were all right, and tau the expected accepted length of one
block with the bonus token, as speculators' `eal`.

Shapes: B rows, T tokens, P anchors per row, L block size, Vd draft vocab.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from eagle3kit.core import dflash, losses, target
from eagle3kit.core.config import DraftConfig, TargetConfig
from eagle3kit.core.metrics import StepCounts, step_counts
from eagle3kit.core.ttt import Batch, TTTConfig, VocabArrays, target_signals

# speculators' default `dflash_decay_gamma`: slot i >= 1 weighs exp(-(i - 1) / GAMMA)
GAMMA = 4.0


def sample_anchors(key: jax.Array, loss_mask_BxT: jax.Array, anchors: int, block_size: int
                   ) -> tuple[jax.Array, jax.Array]:
    """`anchors` distinct columns per row among the trained ones outside the last
    `block_size` -> (columns [B, P] ascending, valid [B, P])."""
    t = loss_mask_BxT.shape[1]
    eligible = (loss_mask_BxT > 0) & (jnp.arange(t) < t - block_size)[None]
    score = jnp.where(eligible, jax.random.uniform(key, loss_mask_BxT.shape), -1.0)
    top, cols = jax.lax.top_k(score, anchors)
    order = jnp.argsort(jnp.where(top >= 0, cols, t), axis=-1)
    return (jnp.take_along_axis(cols, order, axis=-1).astype(jnp.int32),
            jnp.take_along_axis(top >= 0, order, axis=-1))


def anchored_forward(w: dflash.DFlashWeights, cfg: DraftConfig, aux_BxTxA: jax.Array,
                     embed_fn, head_DxVd: jax.Array, tokens_BxT: jax.Array, positions_BxT: jax.Array,
                     segment_ids_BxT: jax.Array, anchors_BxP: jax.Array) -> jax.Array:
    """The draft's logits for every block slot -> [B, P * L, Vd]; `embed_fn(tokens)` is the
    target's embedding, `head_DxVd` the frozen head (`dflash.head_weight`)."""
    b, t = tokens_BxT.shape
    p, n = anchors_BxP.shape[1], cfg.block_size
    take = jax.vmap(lambda row, idx: row[idx])
    anchor_tok = take(tokens_BxT, anchors_BxP)
    block_tok = jnp.where(jnp.arange(n) == 0, anchor_tok[:, :, None], cfg.mask_token_id)
    block_pos = take(positions_BxT, anchors_BxP)[:, :, None] + jnp.arange(n)
    anchor_seg = take(segment_ids_BxT, anchors_BxP)
    sees = ((jnp.arange(t)[None, None, :] < anchors_BxP[:, :, None])
            & (segment_ids_BxT[:, None, :] == anchor_seg[:, :, None])
            & (anchor_seg[:, :, None] > 0))  # B,P,T
    ctx_mask = jnp.repeat(sees, n, axis=1)  # B,P*L,T
    ctx = dflash.context(w, cfg, aux_BxTxA)
    kv = dflash.all_context_kv(w, cfg, ctx, positions_BxT)
    h = dflash.forward(w, cfg, embed_fn(block_tok.reshape(b, p * n)),
                       block_pos.reshape(b, p * n), kv, ctx_mask)
    return dflash.head(head_DxVd, h)


def slot_masks(anchors_BxP, valid_BxP, loss_mask_BxT, segment_ids_BxT, block_size):
    """[B, P, L] bool: slot i of block a is trained (i >= 1, see the module docstring)."""
    t = loss_mask_BxT.shape[1]
    take = jax.vmap(lambda row, idx: row[idx])
    cols = anchors_BxP[:, :, None] + jnp.arange(block_size)
    inside = cols < t
    cols = jnp.minimum(cols, t - 1)
    same = take(segment_ids_BxT, cols) == take(segment_ids_BxT, anchors_BxP)[:, :, None]
    return (inside & same & (take(loss_mask_BxT, cols) > 0) & valid_BxP[:, :, None]
            & (jnp.arange(block_size) > 0))


def decay_weights(block_size: int, gamma: float) -> jax.Array:
    """[L]: 0 for the anchor slot, exp(-(i - 1) / gamma) for slot i >= 1."""
    i = jnp.arange(block_size, dtype=jnp.float32)
    return jnp.where(i > 0, jnp.exp(-jnp.maximum(i - 1, 0) / gamma), 0.0)


def slot_targets(probs_BxTxVd: jax.Array, anchors_BxP: jax.Array, block_size: int
                 ) -> jax.Array:
    """The target's distribution for each slot, at column a + i - 1 -> [B, P, L, Vd] (slot 0
    gets column a - 1's, never trained)."""
    t = probs_BxTxVd.shape[1]
    cols = jnp.clip(anchors_BxP[:, :, None] + jnp.arange(block_size) - 1, 0, t - 1)
    return jax.vmap(lambda row, idx: row[idx])(probs_BxTxVd, cols)


def block_loss(per_BxPxL: jax.Array, trained_BxPxL: jax.Array, gamma: float,
               denominator: jax.Array) -> jax.Array:
    """sum over trained slots of w_i * per-position loss, / denominator (a scalar)."""
    w = decay_weights(per_BxPxL.shape[2], gamma)
    return jnp.sum(jnp.where(trained_BxPxL, per_BxPxL * w, 0.0)) / denominator


def block_counts(logits_BxPxLxVd: jax.Array, wanted_BxPxL: jax.Array, trained_BxPxL: jax.Array,
                 ce_BxPxL: jax.Array, draft_to_target_Vd: jax.Array) -> StepCounts:
    """The acceptance counts of slots 1..L-1 as TTT steps 0..L-2: right where the draft's
    argmax, as a target id, is the target's argmax (`wanted`)."""
    correct = trained_BxPxL & (draft_to_target_Vd[jnp.argmax(logits_BxPxLxVd, axis=-1)]
                               == wanted_BxPxL)
    slots = range(1, logits_BxPxLxVd.shape[2])
    return step_counts([trained_BxPxL[:, :, i] for i in slots],
                       [correct[:, :, i] for i in slots],
                       [jnp.where(trained_BxPxL[:, :, i], ce_BxPxL[:, :, i], 0.0) for i in slots])


# ---- the trainer's entry points (core/trainer.py dispatches on DraftConfig.method) -----------

def row_anchors(batch: Batch, cfg: DraftConfig, count: int) -> tuple[jax.Array, jax.Array]:
    """`sample_anchors` with each row's own key, derived from its tokens: the same row gets
    the same anchors in the loss, in its denominator and when resumed or evaluated."""
    t = batch.tokens.shape[1]
    count = min(count or t // cfg.block_size, t)
    weights = jnp.arange(t, dtype=jnp.uint32) * jnp.uint32(2654435761) + jnp.uint32(1)
    seeds = jnp.sum(batch.tokens.astype(jnp.uint32) * weights, axis=1)

    def one(seed, mask):
        cols, valid = sample_anchors(jax.random.fold_in(jax.random.key(0), seed), mask[None],
                                     count, cfg.block_size)
        return cols[0], valid[0]

    return jax.vmap(one)(seeds, batch.loss_mask)


def valid_counts(batch: Batch, cfg: DraftConfig, tc: TTTConfig) -> jax.Array:
    """[1]: the trained slots of the whole global batch, the loss's denominator."""
    cols, valid = row_anchors(batch, cfg, tc.anchors)
    trained = slot_masks(cols, valid, batch.loss_mask, batch.segment_ids, cfg.block_size)
    return trained.sum(dtype=jnp.float32)[None]


def loss_fn(params: dflash.DFlashWeights, target_w: target.TargetWeights, batch: Batch,
            vocab: VocabArrays, denominators: jax.Array, *, tcfg: TargetConfig,
            dcfg: DraftConfig, ttt: TTTConfig) -> tuple[jax.Array, StepCounts]:
    """Target forward (frozen), every anchor's block in one draft pass, the decayed loss."""
    sig = target_signals(target_w, tcfg, dcfg, vocab, batch, ttt.attention)
    w = dflash.cast(params, ttt.compute_dtype)
    cols, valid = row_anchors(batch, dcfg, ttt.anchors)
    b, p, n = cols.shape[0], cols.shape[1], dcfg.block_size
    logits = anchored_forward(w, dcfg, sig.aux_BxTxA.astype(ttt.compute_dtype),
                              lambda tok: target.embed_tokens(target_w, tok),
                              dflash.head_weight(w, target_w, vocab.draft_to_target), batch.tokens,
                              batch.positions, batch.segment_ids, cols).reshape(b, p, n, -1)
    trained = slot_masks(cols, valid, batch.loss_mask, batch.segment_ids, n)
    target_p = slot_targets(sig.probs_BxTxVd, cols, n)
    per = losses.per_position_loss(ttt.loss, logits, target_p)
    loss = block_loss(per, trained, GAMMA, jnp.maximum(denominators[0], 1.0))
    ce = per if ttt.loss == "kl" else losses.soft_cross_entropy(logits, target_p)
    wanted = slot_targets(sig.argmax_BxT[..., None], cols, n)[..., 0]
    counts = block_counts(logits, wanted, trained, ce, vocab.draft_to_target)
    return loss, counts


loss_denominators = valid_counts  # the trainer's name for it (core/trainer.py)
