"""Speculative decoding with an EAGLE3 draft: the device side of the engine's speculative step.

One verify step of every row (committed x_0..x_n, x_n the row's newest token, at slot n):

    1. the draft proposes d_1..d_K as a chain from column n-1 (decode/draft_cache.py), or a
       tree of N nodes under x_n (decode/tree.py);
    2. the target runs every row's [x_n, d_1..d_K] (or the tree's N tokens, each at position
       n + depth under its ancestors' mask) in ONE batched `row_cache.forward_rows`, the new
       keys written at slots n..n+K of the row;
    3. per row, the longest agreeing prefix d_1..d_a is accepted, plus one token of the
       target's own (at temperature 0 its argmax after d_a: the output equals plain greedy
       decoding); a tree's accepted path has its keys moved to slots n..n+a;
    4. the draft's step-0 entries of columns n..n+a are recomputed from the target's states
       of that verify forward (`extend` over all K+1 columns; the rest is never read).

Temperature > 0 uses the speculative-sampling rule (Leviathan et al. 2023, Chen et al. 2023):
accept d_j with probability min(1, p(d_j) / q(d_j)), else draw the target's token from
norm(max(0, p - q)); q lives on the draft vocab and is mapped to target ids. The output is then
distributed exactly as sampling from the target alone. Trees (topk > 1) verify with
`tree.accept_greedy` or, above temperature 0, `tree.accept_sampled` (tree speculative
sampling, equally exact).

The draft side is per row (`vmap`ped: each row drafts from its own column with its own
cache), the target side batched over the rows. Shapes: C rows, S cache slots, V target
vocab, Vd draft vocab, K draft tokens per step, T = K + 1 (chain) or N (tree) verified
tokens, D hidden, A captured width.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from eagle3kit.core import draft, target
from eagle3kit.core.config import DraftConfig, TargetConfig
from eagle3kit.core.sharding import RULES
from eagle3kit.core.vocab_arrays import VocabArrays
from eagle3kit.decode import draft_cache, parallel_draft, row_cache, tree
from eagle3kit.decode.sampling import pick


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

    @property
    def verified(self) -> int:
        """Tokens one verify step writes per row: K + 1, or a tree's N."""
        return self.nodes if self.is_tree else self.steps + 1

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


@dataclasses.dataclass(frozen=True)
class Speculation:
    """What the engine needs to decode speculatively: the draft, its vocabulary and the
    drafting shape (`dec.temperature` is the engine's sampling temperature)."""

    dcfg: DraftConfig
    draft_w: Any
    vocab: VocabArrays
    dec: DecodeConfig


# ---- acceptance rules (pure; tested on their own) -------------------------------------------

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


# ---- the device step ----------------------------------------------------------------------


def draft_chain(draft_w, dcfg: DraftConfig, target_w, vocab: VocabArrays, h_1x1xD, n, cache,
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


def rows_vmap(f, data: int):
    """`vmap` over the rows, which stay split over the mesh's `data` axis inside."""
    return jax.vmap(f, spmd_axis_name=RULES["batch"] if data > 1 else None)


def extend_rows(spec: Speculation, target_w, aux_CxTxA, next_CxT, start_C, h_at_C,
                dcache: draft_cache.DraftKV, data: int):
    """The draft's step-0 entries of columns start..start+T-1 of each row ->
    (the h of column start + h_at [C,1,D], the draft cache [C,S,Kd,H])."""
    fill = parallel_draft.extend if parallel_draft.is_parallel(spec.dcfg) else draft_cache.extend

    def one(aux, nxt, start, at, k, v):
        h, c = fill(spec.draft_w, spec.dcfg, target_w, aux[None], nxt[None],
                                  start, draft_cache.DraftKV(k[None], v[None]))
        return jax.lax.dynamic_slice_in_dim(h[0], at, 1, axis=0), c.k[0], c.v[0]

    h, k, v = rows_vmap(one, data)(aux_CxTxA, next_CxT, start_C, h_at_C, dcache.k, dcache.v)
    return h, draft_cache.DraftKV(k, v)


def verify_rows(spec: Speculation, tcfg: TargetConfig, target_w: target.LayerList,
                tcache: row_cache.RowCache, dcache: draft_cache.DraftKV, token_C, n_C, h_C,
                keys_C, *, window: int, data: int, rows_impl: str = "xla"):
    """One verify step of every row (module docstring) -> (new tokens [C, K+1] (new[j] is
    x_{n+j+1}, valid for j <= a), accepted a [C], the draft's h of column n+a [C,1,D],
    target cache, draft cache)."""
    dec, dcfg, draft_w, vocab = spec.dec, spec.dcfg, spec.draft_w, spec.vocab
    c = token_C.shape[0]
    keys = jax.vmap(jax.random.split)(keys_C)
    draft_keys, accept_keys = keys[:, 0], keys[:, 1]
    with jax.named_scope("draft"):  # scopes: benchmarks/profile_summary.py
        if dec.is_tree:
            def grow(h, x_n, n, k, v):
                return tree.draft_tree(draft_w, dcfg, target_w, vocab, h[None], x_n, n,
                                       draft_cache.DraftKV(k[None], v[None]), steps=dec.steps,
                                       topk=dec.topk, nodes=dec.nodes)

            t = rows_vmap(grow, data)(h_C, token_C, n_C, dcache.k, dcache.v)
            tokens, positions, block = t.tokens, n_C[:, None] + t.depth, t.ancestors
        else:
            def chain(h, x_n, n, key, k, v):
                cache = draft_cache.DraftKV(k[None], v[None])
                if parallel_draft.is_parallel(dcfg):  # one pass proposes the block
                    idx, probs, cache = parallel_draft.draft_block(
                        draft_w, dcfg, target_w, vocab, h[None], x_n, n, cache, key,
                        dec.steps, dec.temperature)
                else:
                    idx, probs, cache = draft_chain(draft_w, dcfg, target_w, vocab, h[None], n,
                                                    cache, key, dec.steps, dec.temperature)
                return idx, probs, cache.k[0], cache.v[0]

            idx, probs, dk, dv = rows_vmap(chain, data)(h_C, token_C, n_C, draft_keys, dcache.k,
                                                        dcache.v)
            dcache = draft_cache.DraftKV(dk, dv)
            ids = vocab.draft_to_target[idx]
            tokens = jnp.concatenate([token_C[:, None], ids], axis=1)
            positions, block = n_C[:, None] + jnp.arange(dec.steps + 1)[None, :], None
    out, tcache = row_cache.forward_rows(target_w, tcfg, tokens, positions, tcache, prefix_B=n_C,
                                      block_mask_BxTxT=block, window=window,
                                      aux_layer_ids=dcfg.aux_layer_ids, rows_impl=rows_impl)
    with jax.named_scope("lm_head"):
        logits = jnp.einsum("btd,dv->btv", out.hidden_BxTxD, target.lm_head_weight(target_w),
                            preferred_element_type=jnp.float32)
    k1 = jnp.arange(dec.steps + 1)
    if dec.is_tree:
        def accept(key, lg, t):
            if dec.temperature == 0:
                return tree.accept_greedy(lg, t, dec.steps)
            return tree.accept_sampled(key, lg, t, dec.steps, dec.temperature)

        with jax.named_scope("accept"):
            path, a, bonus = rows_vmap(accept, data)(accept_keys, logits, t)
        with jax.named_scope("commit"):
            tcache = tree.commit_paths(tcache, path, n_C)
            ids = jnp.take_along_axis(t.tokens, jnp.roll(path, -1, axis=1), axis=1)
            aux = jnp.take_along_axis(out.aux_BxTxA, path[:, :, None], axis=1)
    else:
        def accept(key, lg, d_ids, q, d_idx):
            if dec.temperature == 0:
                return accept_greedy(lg, d_ids)
            return accept_sampled(key, lg, q, d_idx, vocab.draft_to_target, dec.temperature)

        with jax.named_scope("accept"):
            a, bonus = rows_vmap(accept, data)(accept_keys, logits, ids, probs, idx)
        ids = jnp.concatenate([ids, jnp.zeros((c, 1), jnp.int32)], axis=1)
        aux = out.aux_BxTxA
    new = jnp.where(k1[None, :] < a[:, None], ids, bonus[:, None])
    with jax.named_scope("draft_extend"):
        h, dcache = extend_rows(spec, target_w, aux, new, n_C, a, dcache, data)
    return new, a, h, tcache, dcache
