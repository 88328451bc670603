"""A draft that gets tokens accepted on the tiny random target, and the references to check
the decoder with it, none of which uses `eagle3kit.decode`.

- `greedy`: plain greedy decoding by full forwards without a cache, one token per call.
- the draft: trained in the test with the trainer's TTT loss on the target's own greedy
  continuations of a few prompts (self-distillation, memorised), with the draft vocab of
  the tokens those continuations use, so that long runs get accepted, and some do not.
- `reference_accept_lengths`: speculative decoding spelled out: the K draft tokens of each
  verify step from the TTT rollout's step-k logits at the last committed column (with the
  earlier drafts teacher-forced, which is what the cached chain computes, see
  test_draft_cache.py), the accepted count as the longest prefix agreeing with `greedy`.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from eagle3kit.core import draft, target, ttt
from eagle3kit.core.config import DraftConfig
from eagle3kit.core.draft import DraftWeights
from eagle3kit.core.vocab import VocabMap
from eagle3kit.core.vocab_arrays import VocabArrays
from tests import assets

K = 3  # draft tokens per verify step
NEW = 24  # generated tokens per prompt
T = 64  # every sequence here fits: prompt + NEW + K + 1
PROMPTS = 3
PROMPT_LEN = 11
TRAIN_STEPS = 150


@dataclasses.dataclass
class Accepting:
    tcfg: Any
    target_w: Any
    dcfg: DraftConfig
    draft_w: DraftWeights
    vocab: VocabArrays
    mesh: Any
    prompts: list[list[int]]
    greedy: list[list[int]]  # NEW + K + 1 greedy tokens after each prompt
    accept_lengths: list[list[int]]  # per prompt, the reference's accepted count per step


@functools.partial(jax.jit, static_argnums=0)
def _argmax_all(tcfg, tw, tokens_1xT):
    out = target.forward(tw, tcfg, tokens_1xT)
    return jnp.argmax(target.logits(tw, out.hidden_BxTxD)[0], axis=-1)


def greedy(tcfg, tw, prompt: list[int], n: int) -> list[int]:
    """n greedy tokens after `prompt`, each from a full causal forward (no cache)."""
    seq = list(prompt)
    for _ in range(n):
        padded = np.zeros((1, T), np.int32)
        padded[0, : len(seq)] = seq
        seq.append(int(_argmax_all(tcfg, tw, jnp.asarray(padded))[len(seq) - 1]))
    return seq[len(prompt):]


def _batch(rows: list[list[int]], loss_from: list[int]) -> ttt.Batch:
    tokens, mask, seg = (np.zeros((len(rows), T), np.int32) for _ in range(3))
    for i, r in enumerate(rows):
        tokens[i, : len(r)], seg[i, : len(r)] = r, 1
        mask[i, loss_from[i]: len(r)] = 1
    positions = np.broadcast_to(np.arange(T, dtype=np.int32), (len(rows), T))
    return ttt.Batch(*(jnp.asarray(x) for x in (tokens, mask, seg, positions)))


def build(tcfg, tw, mesh) -> Accepting:
    rng = np.random.default_rng(3)
    prompts = [[int(x) for x in rng.integers(0, tcfg.vocab_size, PROMPT_LEN)]
               for _ in range(PROMPTS)]
    answers = [greedy(tcfg, tw, p, NEW + K + 1) for p in prompts]
    counts = np.zeros(tcfg.vocab_size, np.int64)
    for a in answers:
        np.add.at(counts, a, 1)
    vocab = VocabArrays.from_map(VocabMap.from_counts(counts, 64)[0])
    dcfg = DraftConfig.for_target(tcfg, draft_vocab_size=64)  # as `tiny`: shared programs
    # the prompt's last token predicts the first answer token: train from there
    batch = _batch([p + a for p, a in zip(prompts, answers, strict=True)],
                   [PROMPT_LEN - 1] * PROMPTS)
    sig = jax.jit(ttt.target_signals, static_argnums=(1, 2))(tw, tcfg, dcfg, vocab, batch)
    w = assets.train_draft(dcfg, sig, batch, vocab, K, optax.adamw(1e-2), TRAIN_STEPS)
    acc = Accepting(tcfg, tw, dcfg, w, vocab, mesh, prompts, answers, [])
    acc.accept_lengths = [reference_accept_lengths(acc, p, a, NEW)
                          for p, a in zip(prompts, answers, strict=True)]
    return acc


def stop_token(acc) -> int:
    """A token early in prompt 1's answer that the other two answers never emit."""
    others = set(acc.greedy[0]) | set(acc.greedy[2])
    return next(t for t in acc.greedy[1][3:] if t not in others)


def expected(acc, i: int, limit: int, stops: set[int]) -> list[int]:
    """Prompt i's greedy answer of at most `limit` tokens, ended at a stop token."""
    out = []
    for t in acc.greedy[i][:limit]:
        out.append(t)
        if t in stops:
            break
    return out


@functools.partial(jax.jit, static_argnums=(0, 2))
def _rollout(tcfg, tw, dcfg, w, vocab, batch):
    """[K, B, T, Vd] draft logits of every TTT step at every column, teacher-forced."""
    sig = ttt.target_signals(tw, tcfg, dcfg, vocab, batch)
    valid = ttt.valid_masks(batch, K)
    hidden, keys, values, logits = draft.fuse(w, dcfg, sig.aux_BxTxA), [], [], []
    for k in range(K):
        hidden, key, value, _, _ = ttt._one_step(
            w, hidden, ttt._shift(sig.embeds_BxTxD, 1 + k), batch.positions + k, keys, values,
            batch.segment_ids, sig.probs_BxTxVd, sig.argmax_BxT, valid[k],
            sig.in_draft_BxT, vocab, cfg=dcfg, k=k)
        keys.append(key)
        values.append(value)
        logits.append(draft.head(w, dcfg, hidden))
    return jnp.stack(logits)


def reference_accept_lengths(acc: Accepting, prompt: list[int], answer: list[int],
                             limit: int) -> list[int]:
    """Accepted draft tokens per verify step of greedy speculative decoding."""
    used = np.asarray(acc.vocab.draft_to_target)
    committed = list(prompt) + answer[:1]  # the prefill emits the first token
    lengths = []
    while len(committed) - len(prompt) < limit:
        column = len(committed) - 2  # the last column whose next token is committed
        seq = list(committed)
        drafts = []
        for k in range(K):
            logits = _rollout(acc.tcfg, acc.target_w, acc.dcfg, acc.draft_w, acc.vocab,
                              _batch([seq], [0]))
            drafts.append(int(used[int(np.argmax(logits[k, 0, column]))]))
            seq.append(drafts[-1])
        done = len(committed) - len(prompt)
        a = 0
        while a < K and drafts[a] == answer[done + a]:
            a += 1
        lengths.append(a)
        committed += answer[done: done + a + 1]
    return lengths
