"""Tree drafting and verification (decode/tree.py) against independent implementations.

The tree's structure, mask and accepted path are checked against plain-Python walks over a
hand-built candidate set; the tree forward against the target run along each root-to-node
path on its own; whole decoding against plain greedy decoding (fp32, tiny target). Sampled
verification: against a plain-numpy walk on fixed uniforms, and its emitted tokens against
the target's distribution by chi-square over many keys.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from eagle3kit.core import draft as draft_lib
from eagle3kit.core import target
from eagle3kit.decode import draft_cache, row_cache, tree
from eagle3kit.decode.speculative import DecodeConfig
from tests.decode import accepting, engines
from tests.decode.test_speculative import P_MIN, chi_square_p_value

# S = 3 steps of top-2: step 0 proposes 0, 1; step 1 expands both (2..5); step 2 expands the
# two best of those, 2 (-0.3) and 4 (-1.2), into 6..9. (token, parent candidate, score)
CANDIDATES = [(10, -1, -0.1), (11, -1, -1.0),
              (12, 0, -0.3), (13, 0, -2.0), (14, 1, -1.2), (15, 1, -3.0),
              (16, 2, -0.5), (17, 2, -2.5), (18, 4, -1.3), (19, 4, -4.0)]
ROOT = 5


def reference_tree(candidates, nodes):
    """(tokens, parents, ancestor sets) by sorting and walking parent links in Python."""
    best = sorted(range(len(candidates)), key=lambda i: (-candidates[i][2], i))[: nodes - 1]
    kept = sorted(best)
    node = {c: i + 1 for i, c in enumerate(kept)}
    tokens = [ROOT] + [candidates[c][0] for c in kept]
    parents = [0] + [node[candidates[c][1]] if candidates[c][1] >= 0 else 0 for c in kept]
    ancestors = []
    for t in range(nodes):
        chain, u = {t}, t
        while u:
            u = parents[u]
            chain.add(u)
        ancestors.append(chain)
    return tokens, parents, ancestors


def reference_accept(tokens, parents, best_after):
    """Deepest path from the root whose every node is the target's token after its parent."""
    children = {t: [u for u in range(1, len(tokens)) if parents[u] == t] for t in
                range(len(tokens))}
    path = [0]
    while True:
        nxt = [u for u in children[path[-1]] if tokens[u] == best_after[path[-1]]]
        if not nxt:
            return path, best_after[path[-1]]
        path.append(nxt[0])


def hand_tree(nodes=6):
    tok, par, score = (jnp.asarray(x) for x in zip(*CANDIDATES, strict=True))
    return tree.build(jnp.int32(ROOT), tok.astype(jnp.int32), par.astype(jnp.int32),
                      score.astype(jnp.float32), nodes)


@pytest.mark.parametrize("nodes", [2, 4, 6, 11])
def test_tree_structure_and_mask_equal_a_walk_over_parents(nodes):
    t = hand_tree(nodes)
    tokens, parents, ancestors = reference_tree(CANDIDATES, nodes)
    assert np.asarray(t.tokens).tolist() == tokens
    assert np.asarray(t.parent).tolist() == parents
    assert np.asarray(t.depth).tolist() == [len(a) - 1 for a in ancestors]
    mask = np.asarray(t.ancestors)  # the verify's mask over the tree's tokens
    for i in range(nodes):  # exactly the node's own ancestors and itself
        assert set(np.flatnonzero(mask[i])) == ancestors[i]


def test_hand_tree_is_the_one_worked_out_in_the_comment():
    t = hand_tree(6)  # the 5 best: 0, 2, 6, 1, 4 -> root-10-12-16 and root-11-14
    assert np.asarray(t.tokens).tolist() == [ROOT, 10, 11, 12, 14, 16]
    assert np.asarray(t.parent).tolist() == [0, 0, 0, 1, 2, 3]


@pytest.mark.parametrize("best_after", [
    {0: 11, 2: 14, 4: 7},  # the second branch, two deep, then the target's 7
    {0: 10, 1: 12, 3: 16, 5: 3},  # the whole first branch: a = 3
    {0: 10, 1: 13},  # the first node only: 13 was never drafted under 12's parent
    {0: 99},  # nothing
    {0: 99, 2: 14, 3: 16},  # deeper nodes agree with their parents, whose parents did not
])
def test_accepted_path_equals_a_walk_down_agreeing_children(best_after):
    t = hand_tree(6)
    tokens, parents, _ = reference_tree(CANDIDATES, 6)
    best = [best_after.get(i, 1) for i in range(6)]
    logits = jnp.asarray(np.eye(100)[best] * 4.0, jnp.float32)
    path, a, bonus = tree.accept_greedy(logits, t, steps=3)
    want, want_bonus = reference_accept(tokens, parents, best)
    assert int(a) == len(want) - 1 and int(bonus) == want_bonus
    assert np.asarray(path)[: len(want)].tolist() == want


def _prefill(tcfg, layers, tokens, aux_ids=()):
    """A one-row cache of 32 slots holding `tokens` from slot 0, and the forward's output."""
    cache = row_cache.RowCache.zeros(tcfg, 1, 32, jnp.float32)
    return _rows(tcfg, aux_ids, layers, jnp.asarray(tokens)[None],
                 jnp.arange(len(tokens))[None], cache, prefill=True)


# forward_rows and forward jitted (target config and captured layers static): a program per
# shape, not a primitive at a time
@functools.partial(jax.jit, static_argnums=(0, 1), static_argnames="prefill")
def _rows(tcfg, aux_ids, layers, tokens, positions, cache, prefix=None, block=None,
          prefill=False):
    return row_cache.forward_rows(layers, tcfg, tokens, positions, cache, prefix_B=prefix,
                               block_mask_BxTxT=block, prefill=prefill, aux_layer_ids=aux_ids)


_forward = jax.jit(target.forward, static_argnums=1, static_argnames="aux_layer_ids")


@pytest.fixture(scope="module")
def prefilled(tiny):
    """The tiny target with 9 committed tokens in its cache and the hand tree verified after
    them: node t's keys at slot 9 + t, at position 9 + depth, under the tree's mask (the
    engine's verify forward)."""
    tcfg, tw, dcfg, *_ = tiny
    layers = target.unstack(tw, tcfg)
    prompt = np.random.default_rng(3).integers(0, 96, 9).astype(np.int32)
    _, cache = _prefill(tcfg, layers, prompt)
    t = hand_tree(6)
    out, tree_cache = _rows(tcfg, dcfg.aux_layer_ids, layers, t.tokens[None],
                            (9 + t.depth)[None], cache, jnp.asarray([9]), t.ancestors[None])
    return prompt, t, out, tree_cache, layers


def test_tree_forward_equals_the_target_along_each_path(tiny, prefilled):
    tcfg, tw, dcfg, *_ = tiny
    prompt, t, out, _, _ = prefilled
    tokens, _, ancestors = reference_tree(CANDIDATES, 6)
    # one causal forward per root-to-node path (right-padded: padding comes after, unread)
    paths = [[tokens[u] for u in sorted(ancestors[i])] for i in range(6)]
    rows = np.asarray([[*prompt, *p, *[0] * (4 - len(p))] for p in paths])
    ref = _forward(tw, tcfg, jnp.asarray(rows), aux_layer_ids=dcfg.aux_layer_ids)
    last = np.asarray([len(prompt) + len(p) - 1 for p in paths])
    np.testing.assert_allclose(out.hidden_BxTxD[0], ref.hidden_BxTxD[np.arange(6), last],
                               atol=2e-5)
    np.testing.assert_allclose(out.aux_BxTxA[0], ref.aux_BxTxA[np.arange(6), last], atol=2e-5)


def test_committing_a_path_leaves_the_cache_of_that_sequence(tiny, prefilled):
    tcfg, tw, dcfg, *_ = tiny
    prompt, t, _, tree_cache, layers = prefilled
    path = jnp.asarray([[0, 2, 4, 0]], jnp.int32)  # root-11-14, a = 2
    got = tree.commit_paths(tree_cache, path, jnp.asarray([9]))
    _, ref = _prefill(tcfg, layers, [*prompt, ROOT, 11, 14])
    for name in ("k", "v"):
        for g, r in zip(getattr(got, name), getattr(ref, name), strict=True):
            np.testing.assert_allclose(g[:, :12], r[:, :12], atol=2e-5)


@pytest.fixture(scope="module")
def draft_state(tiny):
    """(n, the draft's h of column n-1, its cache): 9 committed columns of random states."""
    tcfg, tw, dcfg, w, *_ = tiny
    rng = np.random.default_rng(4)
    n = 9
    aux = jnp.asarray(rng.normal(size=(1, n, 3 * tcfg.hidden_size)), jnp.float32)
    nxt = jnp.asarray(rng.integers(0, 96, (1, n)), jnp.int32)
    cache = draft_cache.DraftKV.zeros(dcfg, 1, 32, jnp.float32)
    h, cache = draft_cache.extend(w, dcfg, tw, aux, nxt, jnp.int32(0), cache)
    return n, h[:, -1:], cache


def test_tree_children_are_the_top_k_of_the_chain_along_their_path(tiny, draft_state):
    """k = 2, S = 3, every candidate kept: the children of each expanded node are the top-2
    of the draft run as a plain chain (draft_cache.chain_step) along that node's path, scored
    the parent's score plus their log-probability: each tree entry saw exactly its
    ancestors' entries (not its siblings' or cousins')."""
    _, tw, dcfg, w, vocab, _ = tiny
    n, h_last, cache = draft_state
    t = jax.jit(lambda h: tree.draft_tree(w, dcfg, tw, vocab, h, jnp.int32(ROOT), jnp.int32(n),
                                          cache, steps=3, topk=2, nodes=11))(h_last)
    tokens, parent = np.asarray(t.tokens).tolist(), np.asarray(t.parent).tolist()
    step = jax.jit(lambda h, tok, pos, c: draft_cache.chain_step(w, dcfg, tw, h, tok, pos, c))
    expanded = 0
    for node in range(11):
        children = {tokens[u] for u in range(1, 11) if parent[u] == node}
        if not children:
            continue
        path = [node]
        while path[-1]:
            path.append(parent[path[-1]])
        hid, c = h_last, cache
        logits = draft_lib.head(w, dcfg, h_last)
        for i, u in enumerate(reversed(path[:-1]), start=1):  # the root's children first
            logits, hid, c = step(hid, jnp.asarray([[tokens[u]]]), jnp.int32(n - 1 + i), c)
        logp = np.asarray(jax.nn.log_softmax(logits[0, -1]))
        best = np.argsort(-logp, kind="stable")[:2]
        assert children == {int(vocab.draft_to_target[b]) for b in best}, node
        for u in (u for u in range(1, 11) if parent[u] == node):  # cumulative log-probs
            d = int(np.flatnonzero(np.asarray(vocab.draft_to_target) == tokens[u])[0])
            np.testing.assert_allclose(t.score[u], t.score[node] + logp[d], atol=1e-5)
        expanded += 1
    assert expanded == 1 + 2 + 2  # the root, both step-0 nodes, the two best of step 1


def test_tree_greedy_decoding_equals_plain_greedy(tiny):
    """A wide tree catches a few tokens even from a random draft, so committed paths are
    exercised (the CLI test runs k = 3, test_smollm2.py the real target at 5/4/8)."""
    tcfg, tw, dcfg, w, vocab, mesh = tiny
    dec = DecodeConfig(steps=2, max_new_tokens=32, topk=8, draft_tokens=40)
    base = engines.plain(tcfg, tw, dec, [], mesh)
    decoder = engines.speculative(tcfg, tw, dcfg, w, vocab, dec, [], mesh)
    accepted = 0
    for seed in range(2):
        prompt = [int(x) for x in np.random.default_rng(seed).integers(0, 96, 11)]
        r = engines.one(decoder, prompt, 32)
        assert r.tokens == engines.one(base, prompt, 32).tokens
        assert 1 + sum(a + 1 for a in r.accept_lengths) >= 32
        accepted += sum(r.accept_lengths)
    assert accepted > 0


def test_tree_shapes_sglang_refuses_are_refused():
    for bad, why in ((DecodeConfig(steps=3, topk=1, draft_tokens=6), "chain"),
                     (DecodeConfig(steps=2, topk=2, draft_tokens=8), "outside 2..7")):
        with pytest.raises(ValueError, match=why):
            bad.check()
    DecodeConfig(steps=2, topk=2, draft_tokens=7).check()
    DecodeConfig(steps=3, topk=2, temperature=0.7).check()  # sampled trees are served too


# ---- sampled verification -------------------------------------------------------------------

# A hand-built tree of depth S = 3 over a target vocab of 12 (node: token, parent): the root
# has three children, node 1 two (one of which reaches full depth), node 2 one; token 2 sits
# under two parents. Nodes are in parent-first order, siblings by descending draft score.
SAMPLED_TOKENS = [0, 3, 5, 7, 2, 9, 2, 4]
SAMPLED_PARENTS = [0, 0, 0, 0, 1, 1, 2, 4]
SAMPLED_V, SAMPLED_S = 12, 3
SAMPLED_CASES = {"siblings": 1.0, "unlikely": 0.7}  # case (see sampled_logits): temperature


def make_tree(tokens, parents) -> tree.Tree:
    n = len(tokens)
    anc = np.eye(n, dtype=bool)
    for t in range(1, n):
        anc[t] |= anc[parents[t]]
    return tree.Tree(jnp.asarray(tokens, jnp.int32), jnp.asarray(parents, jnp.int32),
                     jnp.asarray(anc), jnp.asarray(anc.sum(-1) - 1, jnp.int32),
                     jnp.zeros(n, jnp.float32))


def sampled_logits(case: str) -> np.ndarray:
    """[N, V] target logits after each node (the target's rows ignore the real context).

    "siblings": the root's children hold 0.35, 0.25, 0.15 of its p, so the first is often
    rejected and the next accepted; node 1's children and node 4's child are likely, so
    full-depth acceptance is common. "unlikely": the draft's children are tokens the target
    rarely emits (q, which ranks them top, is far from p): most steps end in the residual.
    """
    rng = np.random.default_rng(7)
    logits = rng.normal(size=(len(SAMPLED_TOKENS), SAMPLED_V)) * 0.5
    children = {t: [c for c in range(1, len(SAMPLED_TOKENS)) if SAMPLED_PARENTS[c] == t]
                for t in range(len(SAMPLED_TOKENS))}
    for node, kids in children.items():
        if not kids:
            continue
        want = {"siblings": [0.35, 0.25, 0.15][: len(kids)] if node == 0 else
                [0.5, 0.2][: len(kids)],
                "unlikely": [0.01, 0.03, 0.02][: len(kids)]}[case]
        row = np.exp(logits[node])
        others = np.ones(SAMPLED_V, bool)
        others[[SAMPLED_TOKENS[c] for c in kids]] = False
        row[others] *= (1 - sum(want)) / row[others].sum()
        row[[SAMPLED_TOKENS[c] for c in kids]] = want
        logits[node] = np.log(row)
    return logits


def reference_sampled_walk(u, u_bonus, p, tokens, parents):
    """The rule spelled out (float64): children in order against the residual r, accepted
    when u < r(c) / sum(r), else r <- max(0, r - one-hot(c)); the bonus by inverse CDF."""
    path, cur = [0], 0
    while True:
        r = p[cur].astype(np.float64).copy()
        for c in (c for c in range(1, len(tokens)) if parents[c] == cur):
            if u[c] < r[tokens[c]] / r.sum():
                path.append(c)
                break
            r = np.maximum(r - np.eye(len(r))[tokens[c]], 0.0)
        else:
            cdf = np.cumsum(r / r.sum())
            return path, int(np.searchsorted(cdf, u_bonus * cdf[-1], side="right"))
        cur = path[-1]


@functools.partial(jax.jit, static_argnums=3)
@functools.partial(jax.vmap, in_axes=(0, None, None, None, None))
def _walks(u_N1, logits_NxV, t, steps, temperature):
    return tree.accept_with_uniforms(u_N1[:-1], u_N1[-1], logits_NxV, t, steps, temperature)


@pytest.mark.parametrize("case", list(SAMPLED_CASES))
def test_sampled_acceptance_equals_a_plain_walk_on_fixed_uniforms(case):
    temperature = SAMPLED_CASES[case]
    t = make_tree(SAMPLED_TOKENS, SAMPLED_PARENTS)
    logits = jnp.asarray(sampled_logits(case), jnp.float32)
    u = np.random.default_rng(2).random((300, len(SAMPLED_TOKENS) + 1)).astype(np.float32)
    paths, a, bonus = (np.asarray(x) for x in _walks(jnp.asarray(u), logits, t, SAMPLED_S,
                                                     jnp.float32(temperature)))
    p = np.asarray(jax.nn.softmax(logits / temperature, axis=-1), np.float64)
    lengths = set()
    for i in range(len(u)):
        want, want_bonus = reference_sampled_walk(u[i, :-1], u[i, -1], p, SAMPLED_TOKENS,
                                                  SAMPLED_PARENTS)
        assert (int(a[i]), paths[i, : len(want)].tolist(), int(bonus[i])) == (
            len(want) - 1, want, want_bonus), i
        lengths.add(len(want) - 1)
    # every depth occurs in "siblings" (a full path too), the residual's bonus in both
    assert lengths >= ({0, 1, 2, 3} if case == "siblings" else {0})


DRAWS = 40000


@pytest.fixture(scope="module")
def sampled_draws():
    """DRAWS runs of accept_sampled per case, both cases in one compiled call -> per case
    (emitted tokens [DRAWS, S+1], -1 past the bonus; a; path; p [N, V] float64)."""
    t = make_tree(SAMPLED_TOKENS, SAMPLED_PARENTS)
    logits = jnp.asarray(np.stack([sampled_logits(c) for c in SAMPLED_CASES]), jnp.float32)
    temps = jnp.asarray(list(SAMPLED_CASES.values()), jnp.float32)

    def one(key, logits_NxV, temperature):
        path, a, bonus = tree.accept_sampled(key, logits_NxV, t, SAMPLED_S, temperature)
        steps = jnp.arange(SAMPLED_S + 1)
        ids = t.tokens[jnp.roll(path, -1)]
        return jnp.where(steps < a, ids, jnp.where(steps == a, bonus, -1)), a, path

    per_key = jax.vmap(one, in_axes=(0, None, None))
    run = jax.jit(jax.vmap(per_key, in_axes=(None, 0, 0)))
    x, a, path = (np.asarray(v) for v in run(jax.random.split(jax.random.key(0), DRAWS),
                                              logits, temps))
    p = np.asarray(jax.nn.softmax(logits / temps[:, None, None], axis=-1), np.float64)
    return {c: (x[i], a[i], path[i], p[i]) for i, c in enumerate(SAMPLED_CASES)}


@pytest.mark.parametrize("case", list(SAMPLED_CASES))
def test_sampled_trees_emit_the_targets_distribution(case, sampled_draws):
    """The first emitted token follows p at the root; given the path went through node 1
    (token 3) or node 2 (token 5), the second follows p at that node; after a full-depth
    path (root-3-2-4) the bonus follows p at the leaf, unchanged. One chi-square statistic
    for the first tokens and the conditionals, one for the full-depth bonus; with a fixed
    key, P_MIN = 1e-4 is how unlikely a correct sampler would have to be to fail."""
    x, a, path, p = sampled_draws[case]
    groups = [(x[:, 0], p[0])]
    for node, token in ((1, 3), (2, 5)):
        went = x[:, 0] == token
        groups.append((x[went, 1], p[node]))
    assert len(groups[0][0]) == DRAWS and min(len(s) for s, _ in groups) > (
        1000 if case == "siblings" else 50)
    assert chi_square_p_value(groups) > P_MIN
    # siblings: the first child rejected and the second accepted happens (q = one-hot
    # ranks them; the residual decides), so the test reaches the residual update
    assert ((path[:, 1] == 2).mean() > 0.1) == (case == "siblings")
    if case == "siblings":
        full = a == SAMPLED_S
        assert full.sum() > 2000 and (path[full, 3] == 7).all()
        assert chi_square_p_value([(x[full, 3], p[7])]) > P_MIN


def test_sampled_tree_decoding_runs_and_accepts(accepting_draft):
    """The engine (one row) end to end at temperature 0.8 with top-2 trees and the draft trained on the
    target's greedy answers: every answer is full length in valid ids, and the tree's
    accepted paths are committed in some steps (the greedy tests check commits' contents),
    and the tokens are samples, not the target's argmax after their prefix."""
    acc = accepting_draft
    dec = DecodeConfig(steps=2, topk=2, draft_tokens=5, temperature=0.8,
                       max_new_tokens=accepting.NEW)  # depth 2: a third less to compile
    decoder = engines.speculative(acc.tcfg, acc.target_w, acc.dcfg, acc.draft_w, acc.vocab,
                                  dec, [], acc.mesh)
    accepted, sampled = [], False
    for seed, prompt in enumerate(acc.prompts):
        r = engines.one(decoder, prompt, accepting.NEW, seed=seed)
        # the target's argmax after every prefix (one cache-free forward): greedy
        # verification would emit exactly these after the (sampled) first token
        seq = np.zeros((1, accepting.T), np.int32)
        seq[0, : len(prompt) + accepting.NEW] = prompt + r.tokens
        best = np.asarray(accepting._argmax_all(acc.tcfg, acc.target_w, jnp.asarray(seq)))
        sampled |= r.tokens[1:] != best[len(prompt): len(prompt) + accepting.NEW - 1
                                               ].tolist()
        assert len(r.tokens) == accepting.NEW
        assert all(0 <= i < acc.tcfg.vocab_size for i in r.tokens)
        assert 1 + sum(a + 1 for a in r.accept_lengths) >= accepting.NEW
        assert all(0 <= a <= dec.steps for a in r.accept_lengths)
        accepted += r.accept_lengths
    assert max(accepted) > 0 and sampled, accepted
