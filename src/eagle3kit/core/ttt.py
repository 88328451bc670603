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
a chain-tree mask. Loss: sum_k decay**k * CE_k, CE_k the soft cross-entropy summed over
trained positions divided by the step's masked-token count (`valid_counts`), so gradient
accumulation and data parallelism give exactly the full-batch gradient.

Shapes: B rows, T tokens, D hidden, V target vocab, Vd draft vocab, N/Kh heads, H head dim.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp

from eagle3kit.core import draft, target
from eagle3kit.core.config import DraftConfig, TargetConfig
from eagle3kit.core.layers import _MASKED, attention_scores, causal_mask
from eagle3kit.core.metrics import StepCounts, step_counts
from eagle3kit.core.sharding import constrain


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Batch:
    """Packed rows: several documents per row, told apart by segment ids (0 = padding)."""

    tokens: Any  # B,T int32
    loss_mask: Any  # B,T int32 (1 on assistant tokens)
    segment_ids: Any  # B,T int32
    positions: Any  # B,T int32, restarting at 0 in each document


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class VocabArrays:
    """Device copies of the vocab map."""

    draft_to_target: Any  # Vd int32: target id of each draft id (i + d2t[i])
    t2d: Any  # V bool

    @staticmethod
    def from_map(vocab) -> VocabArrays:
        return VocabArrays(jnp.asarray(vocab.used_ids, jnp.int32), jnp.asarray(vocab.t2d))


@dataclasses.dataclass(frozen=True)
class TTTConfig:
    steps: int = 7
    decay: float = 0.8
    compute_dtype: Any = jnp.bfloat16
    attention: str = "xla"  # the target's attention: "xla" or "cudnn" (layers.attend)


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
                   vocab: VocabArrays, batch: Batch, attention: str = "xla") -> TargetSignals:
    """Runs the frozen target once: captured states, logits, draft-vocab distribution."""
    with jax.named_scope("target"):
        out = target.forward(target_w, tcfg, batch.tokens, batch.segment_ids, batch.positions,
                             dcfg.aux_layer_ids, attention)
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


def _ttt_attend(q_BxTxNxH, keys, values, mask0_BxTxT):
    """Step-0 keys (causal, same document) plus the diagonal keys of steps 1..k."""
    b, t, n, h = q_BxTxNxH.shape
    kh = keys[0].shape[2]
    s0 = attention_scores(q_BxTxNxH, keys[0])  # B,Kh,G,T,T
    s0 = jnp.where(mask0_BxTxT[:, None, None], s0, _MASKED)
    qg = q_BxTxNxH.reshape(b, t, kh, n // kh, h)
    diag = [jnp.einsum("btkgh,btkh->bkgt", qg, k_i, preferred_element_type=jnp.float32)
            * (h ** -0.5) for k_i in keys[1:]]
    s = jnp.concatenate([s0] + [d[..., None] for d in diag], axis=-1)
    p = jax.nn.softmax(s, axis=-1).astype(values[0].dtype)
    o = jnp.einsum("bkgts,bskh->btkgh", p[..., :t], values[0])
    for i, v_i in enumerate(values[1:]):
        o = o + jnp.einsum("bkgt,btkh->btkgh", p[..., t + i], v_i)
    return o.reshape(b, t, n, h)


def _one_step(w, hidden, emb, positions, keys, values, mask0, probs, target_argmax, valid,
              in_draft, vocab, *, cfg: DraftConfig, k: int):
    """Draft step k: returns (h, new key, new value, masked CE [B,T], correct [B,T])."""
    p = draft.project(w, cfg, emb, hidden, positions)
    keys, values = [*keys, p.k_BxTxKxH], [*values, p.v_BxTxKxH]
    a = _ttt_attend(p.q_BxTxNxH, keys, values, mask0)
    h = draft.finish(w, cfg, a, p.residual_BxTxD)
    logits = draft.head(w, cfg, h).astype(jnp.float32)  # B,T,Vd
    logp = jax.nn.log_softmax(logits, axis=-1)
    target_p = _shift(probs, 1 + k)
    train = valid & _shift(in_draft, 1 + k)
    ce = -jnp.sum(target_p * logp, axis=-1) * train
    predicted = vocab.draft_to_target[jnp.argmax(logits, axis=-1)]
    correct = valid & (predicted == _shift(target_argmax, 1 + k))
    return h, p.k_BxTxKxH, p.v_BxTxKxH, ce, correct


def rollout(w: draft.DraftWeights, cfg: DraftConfig, sig: TargetSignals, batch: Batch,
            vocab: VocabArrays, ttt: TTTConfig, denominators_K: jax.Array
            ) -> tuple[jax.Array, StepCounts]:
    """The K-step rollout -> (loss, counts). `w` is cast to `ttt.compute_dtype` here, so
    gradients reach the fp32 master weights in fp32."""
    w = draft.cast(w, ttt.compute_dtype)
    mask0 = causal_mask(batch.segment_ids)
    valid = valid_masks(batch, ttt.steps)
    hidden = draft.fuse(w, sig.aux_BxTxA.astype(ttt.compute_dtype))
    embeds = sig.embeds_BxTxD.astype(ttt.compute_dtype)
    keys, values, ces, corrects = [], [], [], []
    loss = jnp.zeros((), jnp.float32)
    for k in range(ttt.steps):
        # Recompute each step in the backward pass: keeps one step's [B,T,Vd] logits and
        # [B,N,T,T] scores alive instead of K of them.
        step = jax.checkpoint(functools.partial(_one_step, cfg=cfg, k=k))
        hidden, key, value, ce, correct = step(
            w, hidden, _shift(embeds, 1 + k), batch.positions + k, keys, values, mask0,
            sig.probs_BxTxVd, sig.argmax_BxT, valid[k], sig.in_draft_BxT, vocab)
        keys.append(key)
        values.append(value)
        ces.append(ce)
        corrects.append(correct)
        loss = loss + (ttt.decay ** k) * ce.sum() / jnp.maximum(denominators_K[k], 1.0)
    return loss, step_counts(valid, corrects, ces)


def loss_fn(params: draft.DraftWeights, target_w: target.TargetWeights, batch: Batch,
            vocab: VocabArrays, denominators_K: jax.Array, *, tcfg: TargetConfig,
            dcfg: DraftConfig, ttt: TTTConfig) -> tuple[jax.Array, StepCounts]:
    """Target forward (frozen) + draft rollout: the function the trainer differentiates."""
    sig = target_signals(target_w, tcfg, dcfg, vocab, batch, ttt.attention)
    return rollout(params, dcfg, sig, batch, vocab, ttt, denominators_K)
