"""P-EAGLE and DFlash drafts that get tokens accepted on the tiny target, and speculative
decoding with them spelled out without `eagle3kit.decode`.

- the drafts: trained in the test with each method's own training loss (core/peagle.rollout,
  core/dflash_train.loss_fn) on the target's greedy continuations of tests/decode/accepting's
  prompts (memorised), over that draft vocab, so that many blocks are accepted, not all.
- `reference_accept_lengths`: each verify step's block from the method's uncached forward
  over the whole committed sequence (P-EAGLE: core/peagle.forward under its training block
  mask; DFlash: core/dflash.forward over every committed position's context), the accepted
  count as the longest prefix agreeing with plain greedy decoding.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from eagle3kit.core import dflash, dflash_train, peagle, target, ttt
from eagle3kit.core.config import DraftConfig
from tests.decode import accepting

T = accepting.T
BLOCK = {"peagle": 3, "dflash": 4}  # 3 proposals a pass either way (DFlash: L - 1)
TRAIN_STEPS = 200


@dataclasses.dataclass
class Parallel:
    acc: Any  # accepting.Accepting: target, prompts, greedy answers, draft vocab
    dcfg: DraftConfig
    draft_w: Any
    accept_lengths: list[list[int]]  # per prompt, the reference's accepted count per step


def config(acc, method: str) -> DraftConfig:
    return dataclasses.replace(acc.dcfg, method=method, num_layers=2, block_size=BLOCK[method],
                               mask_token_id=acc.tcfg.vocab_size - 1)


def build(acc, method: str) -> Parallel:
    dcfg = config(acc, method)
    batch = accepting._batch([p + a for p, a in zip(acc.prompts, acc.greedy, strict=True)],
                             [accepting.PROMPT_LEN - 1] * accepting.PROMPTS)
    module = peagle if method == "peagle" else dflash
    w = module.initial_weights(dcfg, jax.random.key(0), acc.target_w, acc.vocab, None)
    cfg = ttt.TTTConfig(steps=BLOCK[method], compute_dtype=jnp.float32)
    if method == "peagle":
        sig = jax.jit(ttt.target_signals, static_argnums=(1, 2))(acc.target_w, acc.tcfg, dcfg,
                                                                   acc.vocab, batch)
        den = ttt.valid_counts(batch, cfg.steps)

        def loss(w):
            return peagle.rollout(w, dcfg, sig, batch, acc.vocab, cfg, den)
    else:
        den = dflash_train.valid_counts(batch, dcfg, cfg)

        def loss(w):
            return dflash_train.loss_fn(w, acc.target_w, batch, acc.vocab, den, tcfg=acc.tcfg,
                                        dcfg=dcfg, ttt=cfg)
    tx = optax.adamw(1e-2)

    @jax.jit
    def step(w, opt):
        grads, _ = jax.grad(loss, has_aux=True)(w)
        updates, opt = tx.update(grads, opt, w)
        return optax.apply_updates(w, updates), opt

    opt = tx.init(w)
    for _ in range(TRAIN_STEPS):
        w, opt = step(w, opt)
    par = Parallel(acc, dcfg, w, [])
    par.accept_lengths = [reference_accept_lengths(par, p, a, accepting.NEW)
                          for p, a in zip(acc.prompts, acc.greedy, strict=True)]
    return par


@functools.partial(jax.jit, static_argnums=(0, 2))
def _block(tcfg, tw, dcfg, w, vocab, tokens_1xT, n):
    """Draft logits [proposals, Vd] of the block after committed tokens[:n + 1], uncached."""
    out = target.forward(tw, tcfg, tokens_1xT, aux_layer_ids=dcfg.aux_layer_ids)
    aux = out.aux_BxTxA
    if dcfg.method == "peagle":
        k = dcfg.block_size
        # depth-0 columns t = 0..T-1 (x_{t+1}, aux_t, position t; those from n on are never
        # seen), then depths 1..K-1 of the block anchored at column n - 1
        anchor = jnp.concatenate([jnp.arange(T), jnp.full((k - 1,), n - 1)])
        depth = jnp.concatenate([jnp.zeros((T,), jnp.int32), jnp.arange(1, k)])
        live = (jnp.arange(T) < n).astype(jnp.int32)
        nxt = jnp.concatenate([tokens_1xT[0, 1:], jnp.zeros((1,), jnp.int32)])
        logits = peagle.forward(w, dcfg, nxt[anchor][None], aux[:, anchor],
                                (depth == 0)[None], (anchor + depth)[None],
                                peagle.block_mask(anchor, depth, live)[None])[0]
        return jnp.concatenate([logits[n - 1][None], logits[T:]])
    ctx = dflash.context(w, dcfg, aux)
    kv = dflash.all_context_kv(w, dcfg, ctx, jnp.arange(T)[None])
    block = jnp.full((1, dcfg.block_size), dcfg.mask_token_id).at[0, 0].set(tokens_1xT[0, n])
    sees = jnp.broadcast_to(jnp.arange(T) < n, (1, dcfg.block_size, T))
    h = dflash.forward(w, dcfg, target.embed_tokens(tw, block), n + jnp.arange(dcfg.block_size)[None],
                       kv, sees)
    return dflash.head(dflash.head_weight(w, tw, vocab.draft_to_target), h[:, 1:])[0]


def reference_accept_lengths(par: Parallel, prompt: list[int], answer: list[int],
                             limit: int) -> list[int]:
    """Accepted proposals per verify step of greedy speculative decoding."""
    acc, used = par.acc, np.asarray(par.acc.vocab.draft_to_target)
    committed = list(prompt) + answer[:1]  # the prefill emits the first token
    lengths = []
    while len(committed) - len(prompt) < limit:
        padded = np.zeros((1, T), np.int32)
        padded[0, : len(committed)] = committed
        logits = _block(acc.tcfg, acc.target_w, par.dcfg, par.draft_w, acc.vocab,
                        jnp.asarray(padded), len(committed) - 1)
        drafts = used[np.argmax(np.asarray(logits), axis=-1)]
        done = len(committed) - len(prompt)
        a = 0
        while a < len(drafts) and drafts[a] == answer[done + a]:
            a += 1
        lengths.append(a)
        committed += answer[done: done + a + 1]
    return lengths
