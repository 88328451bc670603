"""attend_rows: the XLA path against a numpy reference written from the definition, and the
Pallas kernel (interpret mode on CPU) against the XLA path.

Every case reads a subset of the cache's rows in another order, at different prefix lengths
(an empty row, rows mid-cache, a row whose new tokens end at the cache's last slot), with
random values in every slot no query may see, so reading a wrong row, a slot past a row's
length or a block too few changes the result by O(1). The cache's 56 slots are no multiple
of the kernel's 16-slot blocks. fp32 throughout: kernel and XLA differ only in summation
order and exp2 against exp, observed under 1e-6; 2e-5 as test_flash.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from eagle3kit.decode.ragged_attention import RaggedBlocks, attend_rows
from tests import triton_lowering

TOL = dict(rtol=2e-5, atol=2e-5)
C, S, H = 6, 56, 16
ROWS = np.array([4, 0, 5, 2])
BLOCKS = RaggedBlocks(k=16, q=16, interpret=True)  # T x G > 16 query rows: row blocks


def tree_mask(rng, t: int) -> tuple[np.ndarray, np.ndarray]:
    """A random tree of t tokens in order (each token's parent is one of the three before it,
    so trees run deep and a token's depth lags its index): its ancestor mask [t, t] (a token
    sees itself and its ancestors) and each token's depth."""
    parent = [-1] + [int(rng.integers(max(0, j - 3), j)) for j in range(1, t)]
    mask = np.eye(t, dtype=bool)
    depth = np.zeros(t, np.int64)
    for j in range(1, t):
        mask[j] |= mask[parent[j]]
        depth[j] = depth[parent[j]] + 1
    return mask, depth


def make_case(t=5, n=6, kh=2, tree=False, window=0, softcap=0.0, sinks=False, seed=0,
              any_mask=False):
    rng = np.random.default_rng(seed)
    prefix = np.array([0, 13, 31, S - t])
    b = len(ROWS)
    if tree:
        masks, depths = zip(*(tree_mask(rng, t) for _ in range(b)), strict=True)
        mask, positions = np.stack(masks), prefix[:, None] + np.stack(depths)
    else:
        mask, positions = None, prefix[:, None] + np.arange(t)
    if any_mask:  # no tree: any pattern a caller may pass, each token seeing itself
        mask = (rng.random((b, t, t)) < 0.5) | np.eye(t, dtype=bool)
    f32 = lambda *s: rng.standard_normal(s).astype(np.float32)  # noqa: E731
    return dict(q=f32(b, t, n, H), k=f32(C, S, kh, H), v=f32(C, S, kh, H), rows=ROWS,
                prefix=prefix, positions=positions, mask=mask, window=window, scale=0.3,
                softcap=softcap, sinks=f32(n) if sinks else None)


def reference(c) -> np.ndarray:
    """The definition, one query and head at a time in float64: the keys a query sees and
    their positions, a softmax over them (and the sink), the values' weighted sum."""
    q, k, v = (c[x].astype(np.float64) for x in ("q", "k", "v"))
    b, t, n, _ = q.shape
    g = n // k.shape[2]
    out = np.zeros(q.shape)
    for i in range(b):
        row, p = c["rows"][i], c["prefix"][i]
        for ti in range(t):
            keys = [(s, s) for s in range(p)]  # (slot, position)
            keys += [(p + j, c["positions"][i, j]) for j in range(t)
                     if (j <= ti if c["mask"] is None else c["mask"][i, ti, j])]
            if c["window"]:
                keys = [(s, pos) for s, pos in keys if c["positions"][i, ti] - pos < c["window"]]
            slots = [s for s, _ in keys]
            for head in range(n):
                scores = k[row, slots, head // g] @ q[i, ti, head] * c["scale"]
                if c["softcap"]:
                    scores = np.tanh(scores / c["softcap"]) * c["softcap"]
                if c["sinks"] is not None:
                    scores = np.append(scores, c["sinks"][head])
                w = np.exp(scores - scores.max())
                w = w / w.sum()
                out[i, ti, head] = w[:len(slots)] @ v[row, slots, head // g]
    return out


def run(c, impl, dtype=jnp.float32, blocks=BLOCKS, window=None):
    as_ = lambda x: None if x is None else jnp.asarray(x)  # noqa: E731
    window = c["window"] if window is None else window
    static = dict(scale=c["scale"], softcap=c["softcap"], impl=impl, blocks=blocks)
    if isinstance(window, int):
        static["window"], window = window, None
    out = _attend(jnp.asarray(c["q"], dtype), jnp.asarray(c["k"], dtype),
                  jnp.asarray(c["v"], dtype), as_(c["rows"]), as_(c["prefix"]),
                  as_(c["positions"]), as_(c["mask"]), window, as_(c["sinks"]), **static)
    return np.asarray(out, np.float32)


@functools.partial(jax.jit, static_argnames=("scale", "softcap", "impl", "blocks", "window"))
def _attend(q, k, v, rows, prefix, positions, mask, traced_window, sinks, **static):
    """attend_rows, compiled (eager dispatch of the XLA path's ops costs seconds a call)."""
    if traced_window is not None:
        static["window"] = traced_window
    return attend_rows(q, k, v, rows, prefix, positions, block_mask_BxTxT=mask,
                       sinks_N=sinks, **static)


CASES = {
    "decode": dict(t=1),
    "decode-gqa4": dict(t=1, n=8, kh=2),
    "chain": dict(t=5),
    "tree": dict(t=8, tree=True),
    "any-mask": dict(t=6, any_mask=True),  # token 0 need not be visible
    "chain-20": dict(t=20),  # new tokens in two 16-slot blocks, 4 query row blocks
    "tree-20": dict(t=20, tree=True, window=4),
    "window": dict(t=5, window=7),  # reaches back across the prefix / new token boundary
    "tree-window": dict(t=8, tree=True, window=3),  # prunes deep new tokens too
    "sinks-window": dict(t=3, window=9, sinks=True),  # gpt-oss
    "softcap-mha": dict(t=4, n=2, softcap=2.0),  # Gemma-2-style cap, one query head a kv head
}


@pytest.mark.parametrize("name", CASES)
def test_xla_equals_the_definition(name):
    c = make_case(**CASES[name])
    np.testing.assert_allclose(run(c, "xla"), reference(c), **TOL)


@pytest.mark.parametrize("name", CASES)
def test_pallas_equals_xla(name):
    c = make_case(**CASES[name])
    np.testing.assert_allclose(run(c, "pallas"), run(c, "xla"), **TOL)


@pytest.mark.parametrize("name", ["chain-20", "tree-window", "sinks-window"])
def test_pallas_split_rows_equal_xla(name):
    """Three programs share each row's key blocks (flash decoding), merged afterwards."""
    c = make_case(**CASES[name])
    split = RaggedBlocks(k=16, q=16, split=3, interpret=True)
    np.testing.assert_allclose(run(c, "pallas", blocks=split), run(c, "xla"), **TOL)


@pytest.mark.parametrize("impl", ["xla", "pallas"])
def test_no_rows_means_every_cache_row_in_order(impl):
    """rows_B None (a decode step of every row, the engine's): batch row b reads cache row b,
    as rows_B = 0..C-1 does."""
    c = make_case(**CASES["tree-window"])
    pick = np.arange(C) % len(ROWS)  # C batch rows: the case's queries and trees again
    depth = c["positions"] - c["prefix"][:, None]
    prefix = np.arange(C) * 7  # an empty row, rows of several lengths
    c.update(q=c["q"][pick], mask=c["mask"][pick], prefix=prefix,
             positions=prefix[:, None] + depth[pick], rows=np.arange(C))
    expected = run(c, impl)
    c["rows"] = None
    np.testing.assert_allclose(run(c, impl), expected, **TOL)
    c["rows"] = np.arange(C)[::-1]  # and rows matter: reading other rows changes the result
    assert np.abs(run(c, impl) - expected).max() > 0.1


def test_pallas_traced_window_and_default_blocks():
    """A window given as a traced scalar (one compiled program for local and global layers),
    0 meaning none; and the default tiles (one block covering the whole short cache)."""
    c = make_case(t=4, tree=True, window=5, sinks=True, seed=3)
    for w in (5, 0):
        np.testing.assert_allclose(run(c, "pallas", window=jnp.int32(w),
                                       blocks=RaggedBlocks(interpret=True)),
                                   run(c, "xla", window=w), **TOL)


def test_pallas_bf16_is_as_close_as_xla_bf16():
    """In bf16 the kernel's error against the exact result is no larger than twice the XLA
    path's own bf16 error (the two round differently, but a wrong key or mask is O(1))."""
    c = make_case(t=4, tree=True, window=20, seed=1)
    exact = reference(c)
    err = {impl: np.abs(run(c, impl, jnp.bfloat16) - exact).max() for impl in ("pallas", "xla")}
    assert err["xla"] < 0.05
    assert err["pallas"] <= 2 * err["xla"]


def test_a_query_seeing_nothing_is_finite():
    """A mask row of all False on an empty prefix: no NaN from either path; with sinks the
    output is 0 (all weight on the sink)."""
    c = make_case(t=3, tree=True, seed=2)
    c["mask"][0, 1] = False
    for impl in ("pallas", "xla"):
        assert np.isfinite(run(c, impl)).all()
    c["sinks"] = np.zeros(6, np.float32)
    for impl in ("pallas", "xla"):
        np.testing.assert_allclose(run(c, impl)[0, 1], 0.0, atol=1e-6)


def test_unknown_impl_and_a_cache_shorter_than_a_block():
    c = make_case(t=1)
    with pytest.raises(ValueError, match="unknown impl"):
        run(c, "cudnn")
    with pytest.raises(ValueError, match="key blocks of at least 16, got 56 and 8"):
        run(c, "pallas", blocks=RaggedBlocks(k=8, q=16, interpret=True))  # Triton's dots
    c["k"], c["v"] = c["k"][:, :8], c["v"][:, :8]
    c["prefix"] = np.array([0, 1, 2, 7])
    c["positions"] = c["prefix"][:, None]
    with pytest.raises(ValueError, match="at least 16 slots"):
        run(c, "pallas")


@pytest.mark.parametrize("split", [1, 3])
@pytest.mark.parametrize("name", ["decode", "chain-20", "tree", "tree-window", "sinks-window"])
def test_the_kernel_lowers_to_a_valid_triton_module(monkeypatch, name, split):
    """The kernel lowered for the GPU (no GPU needed) gives a Triton module that verifies, on
    every path: causal or a tree, one split or several, one new-token chunk or more. Interpret
    mode cannot see this: a tree split across programs once built an scf.for whose bounds had
    two types (i32 and i1), which only the GPU's compile refused."""
    verified = triton_lowering.verified(monkeypatch)
    c = make_case(**CASES[name])
    blocks = RaggedBlocks(k=16, q=16, split=split)
    as_ = lambda x: None if x is None else jnp.asarray(x)  # noqa: E731

    def call(q, k, v, rows, prefix, positions, mask, sinks):
        return attend_rows(q, k, v, rows, prefix, positions, block_mask_BxTxT=mask,
                           window=c["window"], scale=c["scale"], softcap=c["softcap"],
                           sinks_N=sinks, impl="pallas", blocks=blocks)

    args = [as_(c[x]) for x in ("q", "k", "v", "rows", "prefix", "positions", "mask", "sinks")]
    jax.jit(call).trace(*args).lower(lowering_platforms=("cuda",))
    assert verified == [True]
