"""Speculative decoding with an EAGLE3 draft, and plain decoding of the same target, on device.

One verify step (committed x_0..x_n, x_n the target's newest token):

    1. the draft proposes d_1..d_K as a chain from column n-1 (decode/draft_cache.py);
    2. the target runs [x_n, d_1..d_K] at positions n..n+K in one forward with its KV cache;
    3. the longest agreeing prefix d_1..d_a is accepted, plus one token of the target's own
       (at temperature 0 its argmax after d_a: the output equals plain greedy decoding);
    4. the draft's step-0 entries of columns n..n+a are recomputed from the target's states of
       that verify forward (`extend` over all K+1 columns; the rest is never read).

Temperature > 0 uses the speculative-sampling rule (Leviathan et al. 2023, Chen et al. 2023):
accept d_j with probability min(1, p(d_j) / q(d_j)), else draw the target's token from
norm(max(0, p - q)); q lives on the draft vocab and is mapped to target ids. The output is then
distributed exactly as sampling from the target alone. Trees (topk > 1) verify with
`tree.accept_greedy` or, above temperature 0, `tree.accept_sampled` (tree speculative
sampling, equally exact).

Both loops are one `lax.while_loop` each with static shapes (the prompt padded to a bucket,
K+1 tokens per verify), so the host never syncs per token. Shapes: P padded prompt, S cache
slots, V target vocab, Vd draft vocab, K draft tokens per step, D hidden.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from eagle3kit.core import draft, target
from eagle3kit.core.config import DraftConfig, TargetConfig
from eagle3kit.core.ttt import VocabArrays
from eagle3kit.decode import draft_cache, tree


@dataclasses.dataclass(frozen=True)
class DecodeConfig:
    steps: int = 7  # K (SGLang's num-steps): draft steps per verify step, the tree's depth
    max_new_tokens: int = 256
    temperature: float = 0.0  # 0: greedy (lossless against plain greedy decoding)
    topk: int = 1  # children per expanded node (SGLang's eagle-topk); 1 is the chain
    draft_tokens: int | None = None  # N: tree nodes verified, the root included (SGLang's
    # num-draft-tokens); None is the chain's K + 1

    @property
    def nodes(self) -> int:
        return self.steps + 1 if self.draft_tokens is None else self.draft_tokens

    @property
    def is_tree(self) -> bool:
        return self.topk > 1

    def check(self) -> None:
        """Raises ValueError for shapes SGLang would refuse too."""
        most = tree.candidate_count(self.steps, self.topk) + 1
        if self.topk < 1 or self.steps < 1:
            raise ValueError("steps and topk must be >= 1")
        if self.topk == 1 and self.nodes != self.steps + 1:
            raise ValueError(f"a chain (topk 1) verifies steps + 1 = {self.steps + 1} draft "
                             f"tokens, not {self.nodes}")
        if not 2 <= self.nodes <= most:
            raise ValueError(f"draft tokens {self.nodes} outside 2..{most}: {self.steps} "
                             f"steps of top-{self.topk} propose {most - 1} candidates")


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Generation:
    """What one prompt's loop returns (device arrays)."""

    tokens: Any  # S int32: the prompt, then the generated tokens, valid below `length`
    length: Any  # int32: prompt + generated tokens (a stop token may end them earlier)
    accepted: Any  # M int32: draft tokens accepted at each verify step, M = max_new_tokens
    verify_steps: Any  # int32: target forwards after the prefill


# ---- acceptance rules (pure; tested on their own) -------------------------------------------


def pick(logits_V: jax.Array, key: jax.Array, temperature: float
         ) -> tuple[jax.Array, jax.Array | None]:
    """A token from logits: argmax at temperature 0, else a sample; and its distribution."""
    if temperature == 0:
        return jnp.argmax(logits_V, axis=-1).astype(jnp.int32), None
    scaled = logits_V.astype(jnp.float32) / temperature
    return (jax.random.categorical(key, scaled).astype(jnp.int32),
            jax.nn.softmax(scaled, axis=-1))


def accept_greedy(target_logits_JxV: jax.Array, draft_ids_K: jax.Array
                  ) -> tuple[jax.Array, jax.Array]:
    """(accepted count a, the target's token after them). J = K + 1 verify positions."""
    best = jnp.argmax(target_logits_JxV, axis=-1).astype(jnp.int32)
    a = jnp.cumprod(draft_ids_K == best[:-1]).sum().astype(jnp.int32)
    return a, best[a]


def accept_sampled(key: jax.Array, target_logits_JxV: jax.Array, draft_probs_KxVd: jax.Array,
                   draft_idx_K: jax.Array, used_ids_Vd: jax.Array, temperature: float
                   ) -> tuple[jax.Array, jax.Array]:
    """Speculative sampling of a chain -> (accepted count a, the target's next token).

    d_j (draft index `draft_idx[j-1]`, target id used_ids[...]) was drawn from q_j; p_{j-1}
    is the target's distribution at the position before it.
    """
    k = draft_idx_K.shape[0]
    p = jax.nn.softmax(target_logits_JxV.astype(jnp.float32) / temperature, axis=-1)
    ids = used_ids_Vd[draft_idx_K]
    p_d = p[jnp.arange(k), ids]
    q_d = draft_probs_KxVd[jnp.arange(k), draft_idx_K]
    u_key, r_key = jax.random.split(key)
    ok = jax.random.uniform(u_key, (k,)) * q_d < p_d  # probability min(1, p/q)
    a = jnp.cumprod(ok).sum().astype(jnp.int32)
    p_a = p[a]
    # the rejected draft's q over target ids; nothing to subtract when all K were accepted
    q_a = jnp.zeros_like(p_a).at[used_ids_Vd].set(draft_probs_KxVd[jnp.minimum(a, k - 1)])
    residual = jnp.maximum(p_a - jnp.where(a < k, q_a, 0.0), 0.0)
    residual = jnp.where(residual.sum() > 0, residual, p_a)  # p == q: any token of p is right
    return a, jax.random.categorical(r_key, jnp.log(residual)).astype(jnp.int32)


# ---- the loops ------------------------------------------------------------------------------


def _logits(target_w: target.TargetWeights, hidden_1xTxD: jax.Array) -> jax.Array:
    """[T, V] target logits, accumulated and returned in fp32 for both loops alike: 16-bit
    logits tie often at the top, and sampling wants fp32 probabilities anyway."""
    return jnp.einsum("btd,dv->btv", hidden_1xTxD, target.lm_head_weight(target_w),
                      preferred_element_type=jnp.float32)[0]


def _prefill(target_w, tcfg: TargetConfig, aux_ids, prompt_P, prompt_len, cache_len, key,
             temperature):
    """Target forward over the padded prompt -> (output, cache, first generated token)."""
    cache = target.KVCache.zeros(tcfg, 1, cache_len, target_w.embed.dtype)
    out, cache = target.forward_cached(target_w, tcfg, prompt_P[None], jnp.int32(0), cache,
                                       aux_ids)
    last = jax.lax.dynamic_slice_in_dim(out.hidden_BxTxD, prompt_len - 1, 1, axis=1)
    first, _ = pick(_logits(target_w, last)[0], key, temperature)
    return out, cache, first


def _stopped(new_J: jax.Array, count: jax.Array, stop_ids: jax.Array) -> jax.Array:
    """Whether one of the first `count` new tokens is a stop token."""
    hit = (new_J[:, None] == stop_ids[None, :]).any(-1)
    return (hit & (jnp.arange(new_J.shape[0]) < count)).any()


def _draft_chain(draft_w, dcfg: DraftConfig, target_w, vocab: VocabArrays, h_1x1xD, n, cache,
                 key, steps: int, temperature: float):
    """K draft tokens from column n-1 -> (draft indices [K], their q [K,Vd] or None, cache)."""
    keys = jax.random.split(key, steps)
    first, q0 = pick(draft.head(draft_w, dcfg, h_1x1xD)[0, 0], keys[0], temperature)

    def body(carry, i):
        cache, h, d = carry
        token = vocab.draft_to_target[d][None, None]
        logits, h, cache = draft_cache.chain_step(draft_w, dcfg, target_w, h, token,
                                                  n - 1 + i, cache)
        d, q = pick(logits[0, 0], keys[i], temperature)
        return (cache, h, d), (d, q)

    (cache, _, _), (rest, qs) = jax.lax.scan(body, (cache, h_1x1xD, first),
                                             jnp.arange(1, steps))
    idx = jnp.concatenate([first[None], rest])
    probs = None if q0 is None else jnp.concatenate([q0[None], qs])
    return idx, probs, cache


def _verify_chain(target_w, draft_w, vocab, x_n, h_last, n, tcache, dcache, key, *, tcfg,
                  dcfg, dec):
    """One chain verify step -> (new tokens [K+1], accepted a, the target's output over the
    K+1 verified columns, caches)."""
    k = dec.steps
    draft_key, accept_key = jax.random.split(key)
    idx, probs, dcache = _draft_chain(draft_w, dcfg, target_w, vocab, h_last, n, dcache,
                                      draft_key, k, dec.temperature)
    ids = vocab.draft_to_target[idx]
    verify = jnp.concatenate([x_n[None], ids])
    out, tcache = target.forward_cached(target_w, tcfg, verify[None], n, tcache,
                                        dcfg.aux_layer_ids)
    logits = _logits(target_w, out.hidden_BxTxD)
    if dec.temperature == 0:
        a, bonus = accept_greedy(logits, ids)
    else:
        a, bonus = accept_sampled(accept_key, logits, probs, idx, vocab.draft_to_target,
                                  dec.temperature)
    new = jnp.where(jnp.arange(k + 1) < a, jnp.concatenate([ids, bonus[None]]), bonus)
    return new, a, out, tcache, dcache


def _verify_tree(target_w, draft_w, vocab, x_n, h_last, n, tcache, dcache, key, *, tcfg,
                 dcfg, dec):
    """One tree verify step, returning what `_verify_chain` does: the target's output is
    gathered along the accepted path and its keys moved to slots n..n+a. The tree is the
    draft's top-k either way; above temperature 0 only the acceptance samples."""
    t = tree.draft_tree(draft_w, dcfg, target_w, vocab, h_last, x_n, n, dcache,
                        steps=dec.steps, topk=dec.topk, nodes=dec.nodes)
    out, tcache = tree.forward_tree(target_w, tcfg, t, n, tcache, dcfg.aux_layer_ids)
    logits = _logits(target_w, out.hidden_BxTxD)
    if dec.temperature == 0:
        path, a, bonus = tree.accept_greedy(logits, t, dec.steps)
    else:
        path, a, bonus = tree.accept_sampled(key, logits, t, dec.steps, dec.temperature)
    tcache = tree.commit_path(tcache, path, n)
    ids = t.tokens[jnp.roll(path, -1)]  # the path's tokens after the root
    new = jnp.where(jnp.arange(dec.steps + 1) < a, ids, bonus)
    out = target.TargetOutput(out.hidden_BxTxD[:, path], out.aux_BxTxA[:, path])
    return new, a, out, tcache, dcache


def speculative_generate(target_w: target.TargetWeights, draft_w: draft.DraftWeights,
                         vocab: VocabArrays, prompt_P: jax.Array, prompt_len: jax.Array,
                         limit: jax.Array, stop_ids: jax.Array, key: jax.Array, *,
                         tcfg: TargetConfig, dcfg: DraftConfig, dec: DecodeConfig,
                         cache_len: int) -> Generation:
    """Speculative decoding of one prompt (`prompt_P` padded, first `prompt_len` real) until
    a stop token or `limit` (<= dec.max_new_tokens) new tokens."""
    m = prompt_len
    key, prefill_key = jax.random.split(key)
    out, tcache, first = _prefill(target_w, tcfg, dcfg.aux_layer_ids, prompt_P, m, cache_len,
                                  prefill_key, dec.temperature)
    tokens = jnp.zeros((cache_len,), jnp.int32).at[: prompt_P.shape[0]].set(prompt_P)
    tokens = tokens.at[m].set(first)
    # step-0 entries of the prompt: column t reads x_{t+1}; the last one the first new token
    next_tokens = jnp.roll(prompt_P, -1).at[m - 1].set(first)
    dcache = draft_cache.DraftKV.zeros(dcfg, 1, cache_len, draft_w.fc.dtype)
    h, dcache = draft_cache.extend(draft_w, dcfg, target_w, out.aux_BxTxA, next_tokens[None],
                                   jnp.int32(0), dcache)
    h_last = jax.lax.dynamic_slice_in_dim(h, m - 1, 1, axis=1)
    accepted = jnp.full((dec.max_new_tokens,), -1, jnp.int32)
    done = _stopped(first[None], 1, stop_ids) | (limit <= 1)
    state = (tcache, dcache, tokens, m, h_last, accepted, jnp.int32(0), done)

    verify = _verify_tree if dec.is_tree else _verify_chain

    def body(state):
        tcache, dcache, tokens, n, h_last, accepted, it, _ = state
        new, a, out, tcache, dcache = verify(
            target_w, draft_w, vocab, tokens[n], h_last, n, tcache, dcache,
            jax.random.fold_in(key, it), tcfg=tcfg, dcfg=dcfg, dec=dec)
        tokens = jax.lax.dynamic_update_slice(tokens, new, (n + 1,))
        # new[j] is x_{n+j+1}, the token column n+j reads; columns past a are never read
        h, dcache = draft_cache.extend(draft_w, dcfg, target_w, out.aux_BxTxA, new[None], n,
                                       dcache)
        h_last = jax.lax.dynamic_slice_in_dim(h, a, 1, axis=1)
        n = n + a + 1
        done = _stopped(new, a + 1, stop_ids) | (n + 1 - m >= limit)
        return (tcache, dcache, tokens, n, h_last, accepted.at[it].set(a), it + 1, done)

    state = jax.lax.while_loop(lambda s: ~s[-1], body, state)
    _, _, tokens, n, _, accepted, it, _ = state
    return Generation(tokens, n + 1, accepted, it)


def plain_generate(target_w: target.TargetWeights, prompt_P: jax.Array, prompt_len: jax.Array,
                   limit: jax.Array, stop_ids: jax.Array, key: jax.Array, *, tcfg: TargetConfig,
                   dec: DecodeConfig, cache_len: int, aux_layer_ids: tuple[int, ...]
                   ) -> Generation:
    """Plain autoregressive decoding of the target: one token per forward (the baseline)."""
    m = prompt_len
    key, prefill_key = jax.random.split(key)
    _, cache, first = _prefill(target_w, tcfg, aux_layer_ids, prompt_P, m, cache_len,
                               prefill_key, dec.temperature)
    tokens = jnp.zeros((cache_len,), jnp.int32).at[: prompt_P.shape[0]].set(prompt_P)
    tokens = tokens.at[m].set(first)
    done = _stopped(first[None], 1, stop_ids) | (limit <= 1)

    def body(state):
        cache, tokens, n, it, _ = state
        out, cache = target.forward_cached(target_w, tcfg, tokens[n][None, None], n, cache,
                                           aux_layer_ids)
        token, _ = pick(_logits(target_w, out.hidden_BxTxD)[0], jax.random.fold_in(key, it),
                        dec.temperature)
        tokens = tokens.at[n + 1].set(token)
        done = _stopped(token[None], 1, stop_ids) | (n + 2 - m >= limit)
        return cache, tokens, n + 1, it + 1, done

    cache, tokens, n, it, _ = jax.lax.while_loop(lambda s: ~s[-1], body,
                                                 (cache, tokens, m, jnp.int32(0), done))
    return Generation(tokens, n + 1, jnp.zeros((0,), jnp.int32), it)
