"""Top-k and top-p without a sort of the vocabulary: the kept tokens equal a plain sort-based
reference's (float64 numpy) on random rows of every kind the engine meets: temperatures,
ties (rounded and bf16 logits), -inf from top-k, vocabularies up to SmolLM2's 49,152, and
logits of one sign (the float -> int32 key map differs for negatives). Draws themselves:
tests/decode/test_engine.py (chi-square, streams independent of the batch).

fp32 masses and float64's differ by rounding, which decides the kept set only where a
boundary mass lies within rounding of top_p: every row's mask must be the kept set of the
reference at some top_p' within TOL of top_p (a threshold set between those at top_p - TOL
and top_p + TOL), which is the reference's own where no boundary mass lies that close (most
rows: counted, so the test cannot pass on ambiguous rows alone).
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from eagle3kit.decode.sampling import nucleus_mask, truncate

# fp32 masses (masked sums of up to 49,152 terms over their total) differ from float64's by
# under 5e-7 on these rows (measured on CPU); a token whose mass is misplaced moves a
# boundary by its mass, far more on all but the densest tails
TOL = 2e-6
TOP_PS = (1e-6, 0.3, 0.9, 0.95, 0.999999)


def reference(x_V: np.ndarray, top_p: float) -> np.ndarray:
    """The nucleus as a sort finds it: sort descending, keep the ranks whose mass ranked
    above is below top_p, then every token at or above the lowest kept logit."""
    x = x_V.astype(np.float64)
    p = np.exp(x - x.max())
    p /= p.sum()
    order = np.argsort(-x, kind="stable")
    before = np.concatenate([[0.0], np.cumsum(p[order])[:-1]])
    return x >= x[order][before < top_p].min()


def rows(kind: str, b: int, v: int, rng: np.random.Generator) -> np.ndarray:
    """[b, v] fp32 logits over temperatures 0.3-2 and spreads 0.5-6: `normal`, `rounded` (to
    0.25: large tie groups), `bf16` (rounded to bfloat16), `topk` (-inf beyond a random k
    with its ties), `negative` (log-probabilities), `positive` (shifted above 40)."""
    scale = rng.uniform(0.5, 6, (b, 1)) / rng.uniform(0.3, 2, (b, 1))
    x = (rng.normal(size=(b, v)) * scale).astype(np.float32)
    if kind == "rounded":
        x = np.round(x * 4) / 4
    elif kind == "bf16":
        x = np.asarray(jnp.asarray(x, jnp.bfloat16).astype(jnp.float32))
    elif kind == "topk":
        x = np.round(x * 8) / 8  # ties at the k-th too
        k = rng.integers(1, min(v, 300) + 1, b)
        kth = -np.sort(-x, axis=1)[np.arange(b), k - 1]
        x = np.where(x >= kth[:, None], x, -np.inf)
    elif kind == "negative":
        x = x - x.max(1, keepdims=True)
        x = x - np.log(np.exp(x).sum(1, keepdims=True))
    elif kind == "positive":
        x = x - x.min(1, keepdims=True) + 40
    return x.astype(np.float32)


def check(x_BxV: np.ndarray, top_p: float, mask_BxV: np.ndarray) -> int:
    """How many rows have one kept set for every top_p' within TOL of top_p (their mask must
    be it); every other row's mask is one of those the reference keeps for such a top_p'."""
    exact = 0
    for i, (x, mask) in enumerate(zip(x_BxV, mask_BxV, strict=True)):
        lo, hi = reference(x, max(top_p - TOL, 1e-300)), reference(x, top_p + TOL)
        where = (top_p, i, int(lo.sum()), int(mask.sum()), int(hi.sum()))
        assert mask[lo].all() and not mask[~hi].any(), where
        assert x[mask].min() > x[~mask].max(initial=-np.inf), where  # a threshold set
        exact += int((lo == hi).all())
    return exact


_nucleus = jax.jit(nucleus_mask)  # top_p traced: one program per shape


@pytest.mark.parametrize("top_p,kept", [(0.25, 1), (0.5, 2), (0.75, 3)])
def test_a_mass_equal_to_top_p_is_not_below_it(top_p, kept):
    """Four distinct logits whose exp rounds to 1.0, so masses above them are 0, 1/4, 2/4 and
    3/4 exactly, in fp32 as in float64: at top_p = 2/4 the third token's mass above (2/4) is
    not below top_p, so two are kept, as a sort keeps them."""
    x = np.asarray([[0.0, -1e-30, -2e-30, -3e-30]], np.float32)
    assert reference(x[0], top_p).sum() == kept
    assert np.asarray(nucleus_mask(jnp.asarray(x), top_p)).sum() == kept


@pytest.mark.parametrize("top_p,kept", [
    (1e-6, [[1, 0, 0, 0, 0, 0], [1, 1, 0, 0, 0, 0]]),
    (0.3, [[1, 0, 0, 0, 0, 0], [1, 1, 0, 0, 0, 0]]),
    (0.5, [[1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 0, 0]]),
    (0.9, [[1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 0]]),
    (0.999999, [[1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 0]]),
])
def test_nucleus_keeps_ties_at_the_boundary_and_the_top(top_p, kept):
    """Row 0: a tie group of 0.525 below 0.475 at the top, -inf (top-k's) and the lowest float
    (mass 0 in fp32) below it. Row 1: five tokens of 0.2 with logits a hair apart: -0.0 ties
    +0.0, then -1e-30 twice, then -2e-30."""
    x = jnp.asarray([[2.0, 1.0, 1.0, 1.0, -np.inf, -3.4e38],
                     [0.0, -0.0, -1e-30, -1e-30, -2e-30, -np.inf]], jnp.float32)
    assert np.asarray(nucleus_mask(x, top_p)).astype(int).tolist() == kept


@pytest.mark.parametrize("kind", ["normal", "rounded", "bf16", "topk", "negative", "positive"])
@pytest.mark.parametrize("v", [12, 1000, 49152])
def test_nucleus_mask_keeps_what_a_sort_keeps(kind, v):
    """Every row, at top_p 1e-6 to 0.999999 and three drawn at random."""
    rng = np.random.default_rng([v, len(kind)])
    x = rows(kind, 8 if v == 49152 else 48, v, rng)
    exact = total = 0
    for top_p in (*TOP_PS, *rng.uniform(0, 1, 3)):
        exact += check(x, top_p, np.asarray(_nucleus(jnp.asarray(x), top_p)))
        total += len(x)
    assert exact >= 0.6 * total, (exact, total)


@pytest.mark.parametrize("top_k", [1, 7, 50])
def test_top_k_then_top_p_keeps_what_a_sort_keeps(top_k):
    """top_k keeps the k most probable tokens and every tie with the k-th; top-p then takes
    the nucleus of softmax over all of those (ties included), from the k values alone."""
    rng = np.random.default_rng(top_k)
    x = np.round(rows("normal", 48, 1000, rng))  # ties at the k-th, often
    kth = -np.sort(-x, axis=1)[:, top_k - 1 : top_k]
    restricted = np.where(x >= kth, x, -np.inf)
    assert ((restricted > -np.inf).sum(1) > top_k).mean() > 0.4  # ties beyond k
    exact = total = 0
    for top_p in (*TOP_PS, 1.0):
        got = np.asarray(jax.jit(truncate, static_argnums=(1, 2))(jnp.asarray(x), top_k, top_p))
        kept = got > -np.inf
        assert (got[kept] == x[kept]).all()
        exact += check(restricted, top_p, kept)
        total += len(x)
    assert exact >= 0.6 * total, (exact, total)


def test_each_halving_reads_the_logits_alone():
    """Each of the 32 halvings computes exp(x - max) in its own pass over the logits: XLA
    does not store it once to read beside x in every pass (twice the memory traffic, on a GPU
    where these passes are most of top-p's cost). The loop is unrolled: no while loop, whose
    condition a GPU reads back to the host every iteration."""
    hlo = jax.jit(nucleus_mask, static_argnums=1).lower(
        jax.ShapeDtypeStruct((4, 4096), jnp.float32), 0.9).compile().as_text()
    assert len(re.findall(r"= f32\[4,4096\]\S* exponential\(", hlo)) >= 32
    assert " while(" not in hlo
