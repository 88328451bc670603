"""Tree drafting and verification (decode/tree.py) against independent implementations.

The tree's structure, mask and accepted path are checked against plain-Python walks over a
hand-built candidate set; the tree forward against the target run along each root-to-node
path on its own; whole decoding against plain greedy decoding (fp32, tiny target).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from eagle3kit.core import draft as draft_lib
from eagle3kit.core import target
from eagle3kit.decode import draft_cache, tree
from eagle3kit.decode.runner import Decoder
from eagle3kit.decode.speculative import DecodeConfig

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
    start, slots = 7, 24
    mask = np.asarray(tree.verify_mask(t, jnp.int32(start), slots))
    for i in range(nodes):  # committed slots, then exactly the node's own ancestors
        assert set(np.flatnonzero(mask[i])) == set(range(start)) | {start + u for u in
                                                                     ancestors[i]}


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


@pytest.fixture(scope="module")
def prefilled(tiny):
    """The tiny target with 9 committed tokens in its cache and the hand tree after them."""
    tcfg, tw, dcfg, *_ = tiny
    prompt = np.random.default_rng(3).integers(0, 96, 9).astype(np.int32)
    cache = target.KVCache.zeros(tcfg, 1, 32, jnp.float32)
    _, cache = target.forward_cached(tw, tcfg, jnp.asarray(prompt)[None], jnp.int32(0), cache,
                                     dcfg.aux_layer_ids)
    t = hand_tree(6)
    out, tree_cache = tree.forward_tree(tw, tcfg, t, jnp.int32(9), cache, dcfg.aux_layer_ids)
    return prompt, t, out, tree_cache


def test_tree_forward_equals_the_target_along_each_path(tiny, prefilled):
    tcfg, tw, dcfg, *_ = tiny
    prompt, t, out, _ = prefilled
    tokens, _, ancestors = reference_tree(CANDIDATES, 6)
    # one causal forward per root-to-node path (right-padded: padding comes after, unread)
    paths = [[tokens[u] for u in sorted(ancestors[i])] for i in range(6)]
    rows = np.asarray([[*prompt, *p, *[0] * (4 - len(p))] for p in paths])
    ref = target.forward(tw, tcfg, jnp.asarray(rows), aux_layer_ids=dcfg.aux_layer_ids)
    last = np.asarray([len(prompt) + len(p) - 1 for p in paths])
    np.testing.assert_allclose(out.hidden_BxTxD[0], ref.hidden_BxTxD[np.arange(6), last],
                               atol=2e-5)
    np.testing.assert_allclose(out.aux_BxTxA[0], ref.aux_BxTxA[np.arange(6), last], atol=2e-5)


def test_committing_a_path_leaves_the_cache_of_that_sequence(tiny, prefilled):
    tcfg, tw, dcfg, *_ = tiny
    prompt, t, _, tree_cache = prefilled
    path = jnp.asarray([0, 2, 4, 0], jnp.int32)  # root-11-14, a = 2
    got = tree.commit_path(tree_cache, path, jnp.int32(9))
    seq = [*prompt, ROOT, 11, 14]
    ref = target.KVCache.zeros(tcfg, 1, 32, jnp.float32)
    _, ref = target.forward_cached(tw, tcfg, jnp.asarray(seq)[None], jnp.int32(0), ref,
                                   dcfg.aux_layer_ids)
    np.testing.assert_allclose(got.k[:, :, :12], ref.k[:, :, :12], atol=2e-5)
    np.testing.assert_allclose(got.v[:, :, :12], ref.v[:, :, :12], atol=2e-5)


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
    base = Decoder(tcfg, dcfg, tw, w, vocab, DecodeConfig(steps=3, max_new_tokens=32), [], mesh)
    dec = DecodeConfig(steps=2, max_new_tokens=32, topk=8, draft_tokens=40)
    decoder = Decoder(tcfg, dcfg, tw, w, vocab, dec, [], mesh)
    accepted = 0
    for seed in range(2):
        prompt = [int(x) for x in np.random.default_rng(seed).integers(0, 96, 11)]
        r = decoder.speculative(prompt)
        assert r.generated_ids == base.plain(prompt).generated_ids
        assert 1 + sum(a + 1 for a in r.accept_lengths) >= 32
        accepted += sum(r.accept_lengths)
    assert accepted > 0


def test_tree_shapes_sglang_refuses_are_refused():
    for bad, why in ((DecodeConfig(steps=3, topk=1, draft_tokens=6), "chain"),
                     (DecodeConfig(steps=2, topk=2, draft_tokens=8), "outside 2..7"),
                     (DecodeConfig(steps=3, topk=2, temperature=0.7), "greedily")):
        with pytest.raises(ValueError, match=why):
            bad.check()
    DecodeConfig(steps=2, topk=2, draft_tokens=7).check()
