"""Tree drafting and verification with SGLang's EAGLE semantics (`--speculative-num-steps S`,
`--speculative-eagle-topk k`, `--speculative-num-draft-tokens N`).

Drafting from the newest committed token x_n (column n-1's draft state h):

    step 0       the draft head's top-k tokens are the first k candidates, scored by their
                 log-probability;
    step 1..S-1  the k best candidates of the previous step (the frontier) each run one draft
                 step and propose their top-k children, scored by the parent's score plus the
                 child's log-probability (the cumulative draft probability, in logs); the k
                 best of those k*k become the next frontier.

Of the k + (S-1)*k*k candidates the N-1 best by score become the tree, under the root x_n
(N counts the root, as SGLang does; topk 1 and N = S+1 is the chain). A child never outscores
its parent and ties go to the lower index, which a parent always has, so the kept set holds
every ancestor of every node it holds. Nodes are ordered by candidate index: parents first.

The target verifies the N tokens in one forward (`row_cache.forward_rows`, the engine's verify):
node t's keys go to slot n + t, its RoPE position is n + depth(t), and it sees the committed
prefix plus its ancestors and itself (`ancestors_NxN`, the block mask over the new tokens). At temperature 0
the accepted path is the deepest node whose every node equals the target's argmax after its
parent; above 0 it is walked by tree speculative sampling (`accept_sampled`: each child in
turn against the target's residual distribution, the draft's top-k taken as one-hot drafts,
as SGLang's `tree_speculative_sampling_target_only` does). The path's keys are then moved
to the contiguous slots n..n+a (`commit_paths`), and the draft's step-0 entries of those columns are
recomputed from the target's states at the path's nodes.

The draft's entries of tree nodes live in a small buffer of (S-1)*k rows beside its cache:
each attends to the committed step-0 entries (slots < n) and to its own ancestors' entries.

Shapes: N tree nodes (root included), M = k + (S-1)k^2 candidates, E = (S-1)k draft entries,
S cache slots where it says slots, Vd draft vocab, D hidden, A aux width, Kv kv heads, H head dim.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from eagle3kit.core import draft, target
from eagle3kit.core.config import DraftConfig
from eagle3kit.core.layers import attend
from eagle3kit.core.vocab_arrays import VocabArrays
from eagle3kit.decode import row_cache
from eagle3kit.decode.draft_cache import DraftKV


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Tree:
    """The drafted tree under the root (node 0, the committed token x_n)."""

    tokens: Any  # N int32 target ids; tokens[0] = x_n
    parent: Any  # N int32; parent[0] = 0
    ancestors: Any  # N,N bool: ancestors[t, u] = u is t or an ancestor of t
    depth: Any  # N int32: edges from the root
    score: Any  # N float32: cumulative draft log-probability (the root's 0)


def candidate_count(steps: int, topk: int) -> int:
    """M: the candidates S steps of top-k expansion propose."""
    return topk + (steps - 1) * topk * topk


def build(root: jax.Array, cand_tokens_M: jax.Array, cand_parent_M: jax.Array,
          cand_score_M: jax.Array, nodes: int) -> Tree:
    """The tree of the `nodes - 1` best candidates (parent -1: a child of the root)."""
    _, chosen = jax.lax.top_k(cand_score_M, nodes - 1)
    chosen = jnp.sort(chosen)  # candidate order: every parent before its children
    node_of = jnp.zeros(cand_score_M.shape, jnp.int32).at[chosen].set(
        jnp.arange(1, nodes, dtype=jnp.int32))
    cp = cand_parent_M[chosen]
    parent = jnp.concatenate([jnp.zeros(1, jnp.int32),
                              jnp.where(cp < 0, 0, node_of[jnp.maximum(cp, 0)])])
    eye = jnp.eye(nodes, dtype=bool)

    def add(anc, t):  # parents come first, so their row is final when a child reads it
        return anc.at[t].set(anc[parent[t]] | eye[t]), None

    ancestors, _ = jax.lax.scan(add, eye, jnp.arange(1, nodes))
    tokens = jnp.concatenate([root[None].astype(jnp.int32), cand_tokens_M[chosen]])
    score = jnp.concatenate([jnp.zeros(1, jnp.float32), cand_score_M[chosen]])
    return Tree(tokens, parent, ancestors, ancestors.sum(-1).astype(jnp.int32) - 1, score)


def accept_greedy(target_logits_NxV: jax.Array, tree: Tree, steps: int
                  ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(path [S+1] node indices from the root, accepted count a, the target's next token).

    A node agrees when its token is the target's argmax after its parent; the accepted node
    is the deepest one on a path of agreeing nodes (siblings hold distinct tokens, so at most
    one path qualifies at each depth). path[j] for j > a repeats the root (never read).
    """
    best = jnp.argmax(target_logits_NxV, axis=-1).astype(jnp.int32)
    agrees = (tree.tokens == best[tree.parent]).at[0].set(True)
    path, a, last = _deepest_path(tree, agrees, steps)
    return path, a, best[last]


def _deepest_path(tree: Tree, accepted_N: jax.Array, steps: int
                  ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The deepest node whose every ancestor (itself included) is accepted -> (its path
    [steps + 1] node ids from the root, padded with its own id; its depth a; the node)."""
    on_path = (~tree.ancestors | accepted_N[None, :]).all(-1)
    last = jnp.argmax(jnp.where(on_path, tree.depth, -1)).astype(jnp.int32)
    depths = jnp.arange(steps + 1)[:, None]
    at_depth = tree.ancestors[last][None, :] & (tree.depth[None, :] == depths)
    path = jnp.argmax(at_depth, axis=-1).astype(jnp.int32)
    return path, tree.depth[last], last


def accept_sampled(key: jax.Array, target_logits_NxV: jax.Array, tree: Tree, steps: int,
                   temperature: float) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Tree speculative sampling -> what `accept_greedy` returns; the emitted tokens (the
    path's, then the bonus) are distributed as sampling the target alone at `temperature`.

    Needs nothing beyond accept_greedy's inputs: the draft's probabilities are not used (see
    `accept_with_uniforms` for why). Draws N + 1 uniforms from `key`: one per node, one for
    the bonus.
    """
    u = jax.random.uniform(key, (tree.tokens.shape[0] + 1,))
    return accept_with_uniforms(u[:-1], u[-1], target_logits_NxV, tree, steps, temperature)


def accept_with_uniforms(u_N: jax.Array, u_bonus: jax.Array, target_logits_NxV: jax.Array,
                         tree: Tree, steps: int, temperature: float
                         ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """`accept_sampled` on given uniforms in [0, 1): u_N[t] decides node t, u_bonus the bonus.

    The walk (SpecInfer's multi-draft rule with every candidate a one-hot "draft"): from the
    root, try the children of the current node in index order (descending draft probability)
    against the residual r, which starts as the target's p after the node; accept child c when
    u[c] < r(c) / sum(r), i.e. with probability min(1, r(c) / q(c)) for q = one-hot(c); on a
    rejection r <- max(0, r - one-hot(c)), which zeroes c, and the next sibling is tried. The
    bonus is drawn (inverse CDF, u_bonus) from the residual of the last accepted node: p with
    all its children zeroed, or p unchanged at a node without children (a leaf).

    Why one-hot: the children are the draft's top-k, chosen deterministically, so the draft
    "sampled" each with probability 1; the min(1, p/q) rule with the draft's own q would
    assume c ~ q and bias the output. With distinct siblings the walk is exact: child c_i is
    emitted with probability prod_{j<i}(1 - r_j(c_j)) * r_i(c_i) = p(c_i), and any other token
    comes from p with the children removed, renormalised, after all were rejected. SGLang's
    `tree_speculative_sampling_target_only` (sgl-kernel speculative_sampling.cuh) makes the
    same choice: it ignores the draft's probabilities ("target only"), on a rejection sets the
    rejected token's draft probability to the target's so relu(p - q) zeroes it, and samples
    the bonus from that relu; it spends one coin per depth on the siblings' cumulative target
    probability, which selects the same child distribution as one coin per sibling here.

    Computed for all nodes at once: the residual mass left when node t is tried is 1 minus
    its earlier siblings' p, whichever node is current; only the accepted path reads it.
    """
    n = tree.tokens.shape[0]
    p_NxV = jax.nn.softmax(target_logits_NxV.astype(jnp.float32) / temperature, axis=-1)
    p_tok = p_NxV[tree.parent, tree.tokens]  # p of node t's token after its parent
    idx = jnp.arange(n)
    earlier_sibling = ((tree.parent[:, None] == tree.parent[None, :])
                       & (idx[None, :] < idx[:, None]) & (idx[None, :] > 0))  # [t, s]
    left = jnp.maximum(1.0 - (earlier_sibling * p_tok[None, :]).sum(-1), 0.0)
    ok = u_N * left < p_tok
    first_ok = (ok & ~(earlier_sibling & ok[None, :]).any(-1)).at[0].set(True)
    path, a, last = _deepest_path(tree, first_ok, steps)
    # the bonus: every child of `last` was tried and rejected (else the path went deeper)
    is_child = (tree.parent == last) & (idx > 0)
    removed_V = jnp.zeros(p_NxV.shape[-1], bool).at[tree.tokens].max(is_child)
    r_V = jnp.where(removed_V, 0.0, p_NxV[last])
    r_V = jnp.where(r_V.sum() > 0, r_V, p_NxV[last])  # rounding left no mass: p is right
    return path, a, _inverse_cdf(r_V, u_bonus)


def _inverse_cdf(weights_V: jax.Array, u: jax.Array) -> jax.Array:
    """The token whose cumulative weight first exceeds u * total (never a zero-weight one)."""
    cdf = jnp.cumsum(weights_V)
    count = (cdf <= u * cdf[-1]).sum()
    last_positive = weights_V.shape[0] - 1 - jnp.argmax(weights_V[::-1] > 0)
    return jnp.minimum(count, last_positive).astype(jnp.int32)


def commit_paths(cache: row_cache.RowCache, path_CxP: jax.Array, start_C: jax.Array
                 ) -> row_cache.RowCache:
    """Moves the keys of each row's accepted path (slots start+path[j]) to slots start+j,
    in every layer (row c of the cache is batch row c). Slots past the accepted depth get
    the root's keys again: never read, overwritten by the next verify."""
    rows = jnp.arange(path_CxP.shape[0])[:, None]
    src = start_C[:, None] + path_CxP
    dst = start_C[:, None] + jnp.arange(path_CxP.shape[1])[None, :]

    def move(x):  # C,S,Kv,H; path[j] >= j, so reading all before writing is safe
        return x.at[rows, dst].set(x[rows, src], mode="drop")

    return row_cache.RowCache([move(k) for k in cache.k], [move(v) for v in cache.v])


# ---- drafting -------------------------------------------------------------------------------


def _draft_entries(w: draft.DraftWeights, cfg: DraftConfig, embeds_1xkxD, hidden_1xkxD,
                   position, n, cache: DraftKV, buf_k, buf_v, first: int, own_kxE):
    """k draft entries at one position -> (h [1,k,D], buffers): each attends to the step-0
    slots < n of `cache` and to the buffer entries `own` marks (its ancestors and itself)."""
    k = embeds_1xkxD.shape[1]

    def over_prefix_and_ancestors(p: draft.Projected):
        bk = buf_k.at[:, first: first + k].set(p.k_BxTxKxH.astype(buf_k.dtype))
        bv = buf_v.at[:, first: first + k].set(p.v_BxTxKxH.astype(buf_v.dtype))
        prefix = jnp.broadcast_to(jnp.arange(cache.k.shape[1]) < n, (k, cache.k.shape[1]))
        mask = jnp.concatenate([prefix, own_kxE], axis=-1)[None]
        dt = p.q_BxTxNxH.dtype
        keys = jnp.concatenate([cache.k, bk], axis=1).astype(dt)
        values = jnp.concatenate([cache.v, bv], axis=1).astype(dt)
        return attend(p.q_BxTxNxH, keys, values, mask), (bk, bv)

    h, (buf_k, buf_v) = draft.step(w, cfg, embeds_1xkxD, hidden_1xkxD, jnp.full((1, k), position),
                                   over_prefix_and_ancestors)
    return h, buf_k, buf_v


def draft_tree(w: draft.DraftWeights, cfg: DraftConfig, target_w: target.TargetWeights,
               vocab: VocabArrays, h_1x1xD: jax.Array, root: jax.Array, n: jax.Array,
               cache: DraftKV, *, steps: int, topk: int, nodes: int) -> Tree:
    """The tree of `nodes` tokens (root x_n included) drafted from column n-1's h."""
    k, entries = topk, (steps - 1) * topk
    logp = jax.nn.log_softmax(draft.head(w, cfg, h_1x1xD)[0, 0].astype(jnp.float32))
    score, idx = jax.lax.top_k(logp, k)
    tokens, parents, scores = [idx], [jnp.full((k,), -1, jnp.int32)], [score]
    frontier = jnp.arange(k, dtype=jnp.int32)  # candidate indices
    hidden = jnp.broadcast_to(h_1x1xD, (1, k, h_1x1xD.shape[-1]))
    shape = (1, entries, cfg.num_kv_heads, cfg.head_dim)
    buf_k, buf_v = jnp.zeros(shape, cache.k.dtype), jnp.zeros(shape, cache.k.dtype)
    own = jnp.zeros((k, entries), bool)  # the frontier's ancestors' entries
    for i in range(1, steps):
        all_tok, all_score = jnp.concatenate(tokens), jnp.concatenate(scores)
        first = (i - 1) * k
        own = own | (jnp.arange(entries)[None, :] == first + jnp.arange(k)[:, None])
        embeds = target.embed_tokens(target_w, vocab.draft_to_target[all_tok[frontier]][None])
        h, buf_k, buf_v = _draft_entries(w, cfg, embeds, hidden, n - 1 + i, n, cache, buf_k,
                                         buf_v, first, own)
        logp = jax.nn.log_softmax(draft.head(w, cfg, h)[0].astype(jnp.float32))
        child_logp, child_idx = jax.lax.top_k(logp, k)  # k,k
        child_score = all_score[frontier][:, None] + child_logp
        offset = sum(len(t) for t in tokens)
        tokens.append(child_idx.reshape(-1))
        scores.append(child_score.reshape(-1))
        parents.append(jnp.repeat(frontier, k))
        _, best = jax.lax.top_k(child_score.reshape(-1), k)
        frontier = (offset + best).astype(jnp.int32)
        hidden, own = h[:, best // k], own[best // k]
    cand = jnp.concatenate(tokens)
    return build(root, vocab.draft_to_target[cand], jnp.concatenate(parents),
                 jnp.concatenate(scores), nodes)
