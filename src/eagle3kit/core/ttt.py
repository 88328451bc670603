"""Training-time test (TTT): the K-step draft rollout against a frozen target, and its loss.

Alignment (column t of a packed row, step k = 0..K-1):

    input token   x[t+1+k]            (teacher-forced ground truth, target embedding)
    hidden input  fc(aux[t]) at k=0, the previous step's pre-norm output after
    RoPE position position[t] + k
    target        softmax(L[t+1+k] restricted to the draft vocab)  (soft, renormalised)
    trained if    loss_mask[t+k], x[t+1+k] in the same document, and argmax L[t+1+k] is a
                  draft token

Attention ("cache hidden"): at step k, column t attends causally to step 0's keys 0..t of
its own document plus the keys of steps 1..k at column t itself, under one softmax, which is
a chain-tree mask. It runs in blocks of query rows, each against the step-0 keys up to its
last row only (the causal triangle, not the square) and recomputed in the backward pass, so
no [B, N, T, T] score tensor is ever held: T = 16,384 fits. With `attention="pallas"` the
step-0 keys go through a fused flash kernel instead (core/flash.py), which returns each row's
log-sum-exp, and the diagonal keys are merged in by log-sum-exp algebra.

Loss: sum_k sum_t w_k(t) * L_k(t) / n_k, L the per-position loss (`TTTConfig.loss`; the
default is the soft cross-entropy against p), summed over trained positions, w_k the step's
weight (`TTTConfig.position_weights`; the default decay**k) and n_k the step's masked-token
count (`valid_counts`), so gradient accumulation and data parallelism give exactly the
full-batch gradient. core/losses.py defines each loss and weighting.

Shapes: B rows, T tokens, D hidden, V target vocab, Vd draft vocab, N/Kh heads, H head dim.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp

from eagle3kit.core import draft, losses, target
from eagle3kit.core.config import DraftConfig, TargetConfig
from eagle3kit.core.flash import FlashBlocks, flash_attention
from eagle3kit.core.layers import MASKED, attend, causal_mask
from eagle3kit.core.metrics import StepCounts, step_counts
from eagle3kit.core.sharding import constrain
from eagle3kit.core.train_attention import TrainAttention
from eagle3kit.core.vocab_arrays import VocabArrays


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Batch:
    """Packed rows: several documents per row, told apart by segment ids (0 = padding)."""

    tokens: Any  # B,T int32
    loss_mask: Any  # B,T int32 (1 on assistant tokens)
    segment_ids: Any  # B,T int32
    positions: Any  # B,T int32, restarting at 0 in each document


@dataclasses.dataclass(frozen=True)
class TTTConfig:
    steps: int = 7
    decay: float = 0.8
    compute_dtype: Any = jnp.bfloat16
    # the target's and the TTT steps' attention kernels (core/train_attention.py; a string
    # is taken as its name)
    attention: TrainAttention = TrainAttention.XLA
    attention_block: int = 512  # query rows per block of the TTT attention (at most 16 blocks)
    flash_blocks: FlashBlocks | None = None  # the fused kernel's tiles (None: its defaults)
    remat: bool = False  # recompute each whole step in the backward pass (saves memory, ~25%
    # more draft FLOPs); the attention scores are recomputed either way
    loss: str = "kl"  # per-position loss, a key of losses.LOSSES
    position_weights: str = "geometric"  # step weights, one of losses.POSITION_WEIGHTS
    anchors: int = 0  # DFlash: blocks per row (core/dflash_train.py; 0: seq_len // block)

    def __post_init__(self):
        object.__setattr__(self, "attention", TrainAttention(self.attention))


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class TargetSignals:
    """What the frozen target provides for one batch (no gradient flows into it)."""

    embeds_BxTxD: jax.Array
    aux_BxTxA: jax.Array
    probs_BxTxVd: jax.Array  # fp32 target distribution over the draft vocab
    argmax_BxT: jax.Array  # target argmax over the full vocab
    in_draft_BxT: jax.Array  # argmax is a draft token


def _shift(x: jax.Array, n: int) -> jax.Array:
    """x[:, n:] padded with zeros on the right (static n)."""
    if n == 0:
        return x
    pad = [(0, 0)] * x.ndim
    pad[1] = (0, n)
    return jnp.pad(x[:, n:], pad)


def valid_masks(batch: Batch, steps: int) -> list[jax.Array]:
    """Per step k, [B, T] bool: loss_mask[t+k] and x[t+1+k] in column t's document."""
    seg = batch.segment_ids
    return [(_shift(batch.loss_mask, k) > 0) & (_shift(seg, 1 + k) == seg) & (seg > 0)
            for k in range(steps)]


def valid_counts(batch: Batch, steps: int) -> jax.Array:
    """[K] masked-token counts: the loss denominators (sum over the whole global batch)."""
    return jnp.stack([m.sum() for m in valid_masks(batch, steps)]).astype(jnp.float32)


def target_signals(target_w: target.TargetWeights, tcfg: TargetConfig, dcfg: DraftConfig,
                   vocab: VocabArrays, batch: Batch,
                   attention: TrainAttention = TrainAttention.XLA) -> TargetSignals:
    """Runs the frozen target once: captured states, logits, draft-vocab distribution."""
    attention = TrainAttention(attention).target(jax.default_backend())
    with jax.named_scope("target"):
        out = target.forward(target_w, tcfg, batch.tokens, batch.segment_ids, batch.positions,
                             dcfg.aux_layer_ids, attention)
        with jax.named_scope("target_head"):
            logits = target.logits(target_w, out.hidden_BxTxD)
            argmax = jnp.argmax(logits, axis=-1).astype(jnp.int32)
            draft_logits = jnp.take(logits, vocab.draft_to_target, axis=-1).astype(jnp.float32)
            probs = constrain(jax.nn.softmax(draft_logits, axis=-1), ("batch", "seq", None))
        sig = TargetSignals(
            embeds_BxTxD=target.embed_tokens(target_w, batch.tokens),
            aux_BxTxA=out.aux_BxTxA,
            probs_BxTxVd=probs,
            argmax_BxT=argmax,
            in_draft_BxT=vocab.t2d[argmax],
        )
    return jax.tree.map(jax.lax.stop_gradient, sig)


def query_blocks(t: int, block: int) -> list[tuple[int, int]]:
    """[start, stop) row ranges of the TTT attention: `block` rows, at most 16 blocks."""
    block = max(block, -(-t // 16))
    return [(s, min(s + block, t)) for s in range(0, t, block)]


def _attend_block(qg_BxQxKxGxH, k0_BxSxKxH, v0_BxSxKxH, seg_q_BxQ, seg_s_BxS, diag_BxKxGxQxI,
                  vd_BxQxIxKxH, start: int):
    """Rows start..start+Q-1 against step-0 keys 0..S-1 (S = start + Q) and their own I
    diagonal keys, under one softmax -> [B, Q, K, G, H]."""
    q_len, h = qg_BxQxKxGxH.shape[1], qg_BxQxKxGxH.shape[-1]
    s = jnp.einsum("bqkgh,bskh->bkgqs", qg_BxQxKxGxH, k0_BxSxKxH,
                   preferred_element_type=jnp.float32) * (h ** -0.5)
    rows = start + jnp.arange(q_len)
    visible = ((jnp.arange(k0_BxSxKxH.shape[1])[None, :] <= rows[:, None])[None]
               & (seg_q_BxQ[:, :, None] == seg_s_BxS[:, None, :]))  # B,Q,S
    s = jnp.where(visible[:, None, None], s, MASKED)
    m = jnp.max(s, axis=-1)
    if diag_BxKxGxQxI is not None:
        m = jnp.maximum(m, jnp.max(diag_BxKxGxQxI, axis=-1))
    e0 = jnp.exp(s - m[..., None])
    z = jnp.sum(e0, axis=-1)
    if diag_BxKxGxQxI is not None:
        ed = jnp.exp(diag_BxKxGxQxI - m[..., None])
        z = z + jnp.sum(ed, axis=-1)
    dtype = v0_BxSxKxH.dtype
    o = jnp.einsum("bkgqs,bskh->bqkgh", (e0 / z[..., None]).astype(dtype), v0_BxSxKxH)
    if diag_BxKxGxQxI is not None:
        o = o + jnp.einsum("bkgqi,bqikh->bqkgh", (ed / z[..., None]).astype(dtype), vd_BxQxIxKxH)
    return o


def _diagonal(qg_BxTxKxGxH, keys, values):
    """The diagonal keys of steps 1..k: scaled fp32 scores [B, K, G, T, I] and their values
    [B, T, I, K, H], or (None, None) at step 0."""
    if len(keys) < 2:
        return None, None
    h = qg_BxTxKxGxH.shape[-1]
    diag = jnp.stack([jnp.einsum("btkgh,btkh->bkgt", qg_BxTxKxGxH, k_i,
                                 preferred_element_type=jnp.float32) * (h ** -0.5)
                      for k_i in keys[1:]], axis=-1)
    return diag, jnp.stack(values[1:], axis=2)


def _ttt_attend_fused(q_BxTxNxH, keys, values, segment_ids_BxT,
                      blocks: FlashBlocks | None = None):
    """The step-0 keys through the flash kernel (out0, lse0), the diagonal keys merged in by
    log-sum-exp: out = (e^(lse0 - m) out0 + sum_i e^(d_i - m) v_i) / (e^(lse0 - m) +
    sum_i e^(d_i - m)), m the row maximum; elementwise over [B, N, T, I]."""
    b, t, n, h = q_BxTxNxH.shape
    kh = keys[0].shape[2]
    o0_BxTxNxH, lse0_BxNxT = flash_attention(q_BxTxNxH, keys[0], values[0], segment_ids_BxT,
                                             blocks)
    diag, vd = _diagonal(q_BxTxNxH.reshape(b, t, kh, n // kh, h), keys, values)
    if diag is None:
        return o0_BxTxNxH
    lse0 = lse0_BxNxT.reshape(b, kh, n // kh, t)
    m = jnp.maximum(lse0, jnp.max(diag, axis=-1))
    w0 = jnp.exp(lse0 - m)
    wd = jnp.exp(diag - m[..., None])
    z = w0 + jnp.sum(wd, axis=-1)
    dtype = values[0].dtype
    o = (o0_BxTxNxH.reshape(b, t, kh, n // kh, h).astype(jnp.float32)
         * jnp.einsum("bkgt->btkg", w0 / z)[..., None])
    o = o + jnp.einsum("bkgti,btikh->btkgh", (wd / z[..., None]).astype(dtype), vd,
                       preferred_element_type=jnp.float32)
    return o.astype(dtype).reshape(b, t, n, h)


def _ttt_attend(q_BxTxNxH, keys, values, segment_ids_BxT, block: int = 512,
                impl: str = "xla", flash_blocks: FlashBlocks | None = None):
    """Step-0 keys (causal, same document) plus the diagonal keys of steps 1..k -> [B, T, N, H].

    `impl="xla"`: blockwise; each block of query rows sees the step-0 keys up to its own
    last row, so the blocks above the diagonal are never computed; `jax.checkpoint`
    recomputes a block's scores in the backward pass instead of saving them.
    `impl="pallas"`: the fused kernel with the log-sum-exp merge (`_ttt_attend_fused`).
    """
    if impl == "pallas":
        return _ttt_attend_fused(q_BxTxNxH, keys, values, segment_ids_BxT, flash_blocks)
    b, t, n, h = q_BxTxNxH.shape
    kh = keys[0].shape[2]
    qg = q_BxTxNxH.reshape(b, t, kh, n // kh, h)
    diag, vd = _diagonal(qg, keys, values)
    outs = []
    for start, stop in query_blocks(t, block):
        fn = jax.checkpoint(functools.partial(_attend_block, start=start))
        outs.append(fn(qg[:, start:stop], keys[0][:, :stop], values[0][:, :stop],
                       segment_ids_BxT[:, start:stop], segment_ids_BxT[:, :stop],
                       None if diag is None else diag[:, :, :, start:stop],
                       None if vd is None else vd[:, start:stop]))
    return jnp.concatenate(outs, axis=1).reshape(b, t, n, h)


def _one_step(w, hidden, emb, positions, keys, values, segment_ids, probs, target_argmax, valid,
              in_draft, vocab, *, cfg: DraftConfig, k: int, block: int = 512,
              attention: TrainAttention = TrainAttention.XLA,
              flash_blocks: FlashBlocks | None = None, loss: str = "kl"):
    """Draft step k: returns (h, new key, new value, (masked loss [B,T], masked soft CE
    [B,T]), correct [B,T]); the CE is the loss itself under `loss="kl"`.

    Step 0 has no diagonal keys: its attention is plain causal attention, which runs through
    `layers.attend` (cuDNN flash attention when `attention="cudnn"`); `attention="pallas"`
    runs every step through the fused kernel.
    """
    def across_steps(p: draft.Projected):
        """This step's keys join the earlier steps' (the "cache hidden" attention)."""
        with jax.named_scope("ttt_attention"):
            if k == 0 and attention == TrainAttention.CUDNN:
                a = attend(p.q_BxTxNxH, p.k_BxTxKxH, p.v_BxTxKxH, causal_mask(segment_ids),
                           "cudnn")
            else:
                a = _ttt_attend(p.q_BxTxNxH, [*keys, p.k_BxTxKxH], [*values, p.v_BxTxKxH],
                                segment_ids, block,
                                "pallas" if attention == TrainAttention.PALLAS else "xla",
                                flash_blocks)
        return a, (p.k_BxTxKxH, p.v_BxTxKxH)

    with jax.named_scope(f"ttt_step{k}"):
        h, (key, value) = draft.step(w, cfg, emb, hidden, positions, across_steps)
        logits = draft.head(w, cfg, h)  # B,T,Vd in the compute dtype
        with jax.named_scope("loss"):
            train = valid & _shift(in_draft, 1 + k)
            p_k = _shift(probs, 1 + k)
            ce = losses.soft_cross_entropy(logits, p_k) * train
            trained = ce if loss == "kl" else losses.per_position_loss(loss, logits, p_k) * train
            predicted = vocab.draft_to_target[jnp.argmax(logits, axis=-1)]
            correct = valid & (predicted == _shift(target_argmax, 1 + k))
    return h, key, value, (trained, ce), correct


def rollout(w: draft.DraftWeights, cfg: DraftConfig, sig: TargetSignals, batch: Batch,
            vocab: VocabArrays, ttt: TTTConfig, denominators_K: jax.Array
            ) -> tuple[jax.Array, StepCounts]:
    """The K-step rollout -> (loss, counts). `w` is cast to `ttt.compute_dtype` here, so
    gradients reach the fp32 master weights in fp32."""
    w = draft.cast(w, ttt.compute_dtype)
    valid = valid_masks(batch, ttt.steps)
    hidden = draft.fuse(w, cfg, sig.aux_BxTxA.astype(ttt.compute_dtype))
    embeds = sig.embeds_BxTxD.astype(ttt.compute_dtype)
    keys, values, trained, ces, corrects = [], [], [], [], []
    for k in range(ttt.steps):
        step = functools.partial(_one_step, cfg=cfg, k=k, block=ttt.attention_block,
                                 attention=ttt.attention, flash_blocks=ttt.flash_blocks,
                                 loss=ttt.loss)
        if ttt.remat:  # keeps one step's activations alive in the backward pass, not K
            step = jax.checkpoint(step)
        hidden, key, value, (loss_k, ce), correct = step(
            w, hidden, _shift(embeds, 1 + k), batch.positions + k, keys, values,
            batch.segment_ids,
            sig.probs_BxTxVd, sig.argmax_BxT, valid[k], sig.in_draft_BxT, vocab)
        keys.append(key)
        values.append(value)
        trained.append(loss_k)
        ces.append(ce)
        corrects.append(correct)
    weights = losses.position_weights(ttt.position_weights, ttt.decay, valid, corrects)
    return losses.weighted_loss(trained, weights, denominators_K), step_counts(valid, corrects,
                                                                               ces)


def loss_fn(params: draft.DraftWeights, target_w: target.TargetWeights, batch: Batch,
            vocab: VocabArrays, denominators_K: jax.Array, *, tcfg: TargetConfig,
            dcfg: DraftConfig, ttt: TTTConfig) -> tuple[jax.Array, StepCounts]:
    """Target forward (frozen) + draft rollout: the function the trainer differentiates."""
    sig = target_signals(target_w, tcfg, dcfg, vocab, batch, ttt.attention)
    return rollout(params, dcfg, sig, batch, vocab, ttt, denominators_K)


# What a method whose columns attend like TTT's steps (core/peagle.py) shares with this one.
shift, attend_across_steps = _shift, _ttt_attend
