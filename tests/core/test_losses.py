"""Each loss and each step weighting against a plain float64 numpy reference: values, and
gradients against central finite differences of the reference (lk-hybrid's lambda held at
its value at the unperturbed point: the stop-gradient the LK paper and speculators use)."""

from __future__ import annotations

import contextlib
import io

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.ad_checkpoint import print_saved_residuals

from eagle3kit.core import losses
from eagle3kit.jobs.config import LOSSES, POSITION_WEIGHTS

B, T, VD = 2, 4, 12


def np_softmax(z):
    e = np.exp(z - z.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def reference(name, z, p, lam=None):
    """[B, T] float64, written from the definitions."""
    q = np_softmax(z)
    log_q = np.log(q)
    alpha = np.minimum(p, q).sum(-1)
    p_log_p = np.where(p > 0, p * np.log(np.where(p > 0, p, 1.0)), 0.0).sum(-1)
    ce = -(p * log_q).sum(-1)
    kl = ce + p_log_p
    if name == "kl":
        return ce
    if name == "tv":
        return 1 - alpha
    if name == "nla":
        return -np.log(np.maximum(alpha, 1e-5))
    if name == "lk-hybrid":
        lam = np.exp(-3 * alpha) if lam is None else lam
        return lam * kl + (1 - lam) * (1 - alpha)
    if name == "jsd":
        m = (p + q) / 2
        safe_p = np.where(p > 0, p, 1.0)
        return 0.5 * (np.where(p > 0, p * np.log(safe_p / m), 0.0).sum(-1)
                      + (q * np.log(q / m)).sum(-1))
    raise AssertionError(name)


def finite_difference(f, z, eps=1e-6):
    g = np.zeros_like(z)
    for i in np.ndindex(z.shape):
        up, down = z.copy(), z.copy()
        up[i] += eps
        down[i] -= eps
        g[i] = (f(up) - f(down)) / (2 * eps)
    return g


@pytest.fixture(scope="module")
def data():
    """Draft logits and target distributions with some exact zeros (underflowed entries),
    renormalised; per-position cotangents so that every position's gradient counts."""
    rng = np.random.default_rng(0)
    z = 2.0 * rng.standard_normal((B, T, VD))
    p = np_softmax(2.0 * rng.standard_normal((B, T, VD)) + z)  # overlapping, not equal
    p[rng.random((B, T, VD)) < 0.2] = 0.0
    p /= p.sum(-1, keepdims=True)
    c = rng.uniform(0.5, 1.5, (B, T))
    z32, p32 = z.astype(np.float32), p.astype(np.float32)
    return z32.astype(np.float64), p32.astype(np.float64), c


def test_the_names_the_command_line_offers_are_the_implemented_ones():
    assert tuple(losses.LOSSES) == LOSSES
    assert losses.POSITION_WEIGHTS == POSITION_WEIGHTS


@pytest.mark.parametrize("name", LOSSES)
def test_loss_value_and_gradient_match_numpy(name, data):
    z, p, c = data
    got = losses.per_position_loss(name, jnp.asarray(z, jnp.float32), jnp.asarray(p, jnp.float32))
    assert got.dtype == jnp.float32 and got.shape == (B, T)
    want = reference(name, z, p)
    np.testing.assert_allclose(np.asarray(got), want, rtol=2e-5, atol=2e-6)
    grad = jax.grad(lambda x: jnp.sum(jnp.asarray(c, jnp.float32) * losses.per_position_loss(
        name, x, jnp.asarray(p, jnp.float32))))(jnp.asarray(z, jnp.float32))
    lam = np.exp(-3 * np.minimum(p, np_softmax(z)).sum(-1))  # frozen at the point itself
    want_grad = finite_difference(lambda x: np.sum(c * reference(name, x, p, lam)), z)
    assert np.abs(want_grad).max() > 1e-2
    np.testing.assert_allclose(np.asarray(grad), want_grad, atol=2e-5 * np.abs(want_grad).max())


def test_lk_hybrid_weight_is_held_constant_in_the_backward_pass(data):
    """The gradient differs from the one through lambda by -3 lambda grad(alpha) (KL - TV):
    measurably, so the test above could not pass with lambda differentiated."""
    z, p, c = data
    through = finite_difference(lambda x: np.sum(c * reference("lk-hybrid", x, p)), z)
    lam = np.exp(-3 * np.minimum(p, np_softmax(z)).sum(-1))
    held = finite_difference(lambda x: np.sum(c * reference("lk-hybrid", x, p, lam)), z)
    assert np.abs(through - held).max() > 100 * 2e-5 * np.abs(held).max()


def test_acceptance_is_the_overlap_and_tv_its_complement(data):
    """alpha = sum min(p, q): 1 where q = p, and 1 - alpha is half the L1 distance."""
    z, p, _ = data
    q = np_softmax(z)
    alpha = losses.acceptance(jnp.asarray(z, jnp.float32), jnp.asarray(p, jnp.float32))
    np.testing.assert_allclose(np.asarray(alpha), 1 - 0.5 * np.abs(p - q).sum(-1), atol=1e-6)
    same = losses.acceptance(jnp.asarray(z, jnp.float32), jnp.asarray(q, jnp.float32))
    np.testing.assert_allclose(np.asarray(same), 1.0, atol=1e-6)
    for name in ("tv", "lk-hybrid", "jsd"):  # divergences: 0 at q = p
        at_p = losses.per_position_loss(name, jnp.asarray(z, jnp.float32),
                                        jnp.asarray(q, jnp.float32))
        np.testing.assert_allclose(np.asarray(at_p), 0.0, atol=2e-6)


@pytest.mark.parametrize("name", LOSSES)
def test_padding_rows_and_disjoint_supports_stay_finite(name):
    """p all zero (a padding column: its loss is masked) and p on tokens the draft gives
    ~1e-9 (alpha under the NLA floor): finite values and gradients; masked, no gradient."""
    z = np.zeros((1, 2, VD), np.float32)
    z[0, 1, :6] = 20.0  # q of tokens 6.. is ~e^-20
    p = np.zeros((1, 2, VD), np.float32)
    p[0, 1, 6:] = 1 / 6
    mask = jnp.asarray([[0.0, 1.0]])

    def f(x):
        return jnp.sum(mask * losses.per_position_loss(name, x, jnp.asarray(p)))

    value, grad = jax.value_and_grad(f)(jnp.asarray(z))
    assert np.isfinite(float(value)) and np.isfinite(np.asarray(grad)).all()
    assert not np.asarray(grad)[0, 0].any()
    full = losses.per_position_loss(name, jnp.asarray(z), jnp.asarray(p))
    assert np.isfinite(np.asarray(full)).all()


@pytest.mark.parametrize("name", LOSSES)
def test_the_backward_pass_keeps_only_the_inputs(name):
    """No fp32 [B, T, Vd] intermediate (q, log q, min(p, q)) is saved for the backward pass:
    per TTT step each would be 1 GiB at B*T = 8K and a 32K draft vocab."""
    z = jnp.zeros((B, T, VD), jnp.bfloat16)
    p = jnp.full((B, T, VD), 1 / VD, jnp.float32)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        print_saved_residuals(lambda x: losses.per_position_loss(name, x, p).sum(), z)
    saved = printed.getvalue().splitlines()  # "f32[2,4,12] output of exp from ..."
    assert any(f"bf16[{B},{T},{VD}] from the argument" in x for x in saved), saved
    large = [x for x in saved if f"[{B},{T},{VD}]" in x and " output of " in x]
    assert not large, large


def test_kl_is_the_soft_cross_entropy_of_today():
    """`kl` is literally the function the rollout always used (bit-for-bit losses)."""
    assert losses.LOSSES["kl"] is losses.soft_cross_entropy


# ---- step weights ---------------------------------------------------------------------------

def reference_weights(name, decay, valid, accepted):
    """[K, B, T] float64 from the definition, one column at a time."""
    k_steps = valid.shape[0]
    out = np.zeros(valid.shape)
    for col in np.ndindex(valid.shape[1:]):
        if name == "geometric":
            out[(slice(None), *col)] = decay ** np.arange(k_steps)
            continue
        acc = accepted[(slice(None), *col)]
        first = int(np.argmin(acc)) if not acc.all() else k_steps
        v = np.array([1.0 if k <= first else decay ** (k - first) for k in range(k_steps)])
        ok = valid[(slice(None), *col)]
        geometric = sum(decay ** k for k in range(k_steps) if ok[k])
        mine = sum(v[k] for k in range(k_steps) if ok[k])
        out[(slice(None), *col)] = v * geometric / mine if mine else 0.0
    return out


@pytest.fixture(scope="module")
def steps():
    """K = 5 steps over 3 x 8 columns: every first-miss position, masked steps in between,
    a column with no valid step."""
    rng = np.random.default_rng(1)
    k_steps = 5
    valid = rng.random((k_steps, 3, 8)) < 0.85
    valid[:, 0, 0] = False
    accepted = valid & (rng.random((k_steps, 3, 8)) < 0.7)
    accepted[:, 1, :] = valid[:, 1, :]  # accepted wherever valid: late first misses
    accepted[0, 2, 1] = False  # missed at step 0
    losses_k = rng.uniform(0.1, 3.0, (k_steps, 3, 8)) * valid
    return valid, accepted, losses_k


@pytest.mark.parametrize("name", POSITION_WEIGHTS)
def test_position_weights_match_the_definition(name, steps):
    valid, accepted, _ = steps
    got = losses.position_weights(name, 0.8, list(jnp.asarray(valid)),
                                  list(jnp.asarray(accepted)))
    got = np.stack([np.broadcast_to(np.asarray(w), valid.shape[1:]) for w in got])
    np.testing.assert_allclose(got, reference_weights(name, 0.8, valid, accepted), rtol=1e-6)
    if name == "verify":  # not the geometric weights, yet the same total in each column
        assert np.abs(got - reference_weights("geometric", 0.8, valid, accepted)).max() > 0.1
        np.testing.assert_allclose((got * valid).sum(0), (
            0.8 ** np.arange(len(valid))[:, None, None] * valid).sum(0), rtol=1e-6)
        rejected_first = ~accepted[0, 2, 1]
        assert rejected_first and np.allclose(got[:, 2, 1], 0.8 ** np.arange(len(valid)))


@pytest.mark.parametrize("name", POSITION_WEIGHTS)
def test_weighted_loss_value_and_gradient(name, steps):
    """sum_k sum_t w_k(t) l_k(t) / n_k; its gradient in l is w / n."""
    valid, accepted, losses_k = steps
    den = jnp.asarray(valid.sum((1, 2)), jnp.float32)

    def f(ls):
        w = losses.position_weights(name, 0.8, list(jnp.asarray(valid)),
                                    list(jnp.asarray(accepted)))
        return losses.weighted_loss(list(ls), w, den)

    value, grad = jax.value_and_grad(f)(jnp.asarray(losses_k, jnp.float32))
    w = reference_weights(name, 0.8, valid, accepted)
    n = valid.sum((1, 2))[:, None, None]
    np.testing.assert_allclose(float(value), (w * losses_k / n).sum(), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(grad), w / n, rtol=1e-6)


def test_verify_end_to_end_gradient_in_the_logits():
    """tv under verify weights, the acceptance indicator from the draft's own argmax: the
    gradient in the logits equals finite differences of the numpy reference, where the
    indicator is a constant (the weights pass no gradient)."""
    rng = np.random.default_rng(2)
    k_steps = 3
    z = (2 * rng.standard_normal((k_steps, B, T, VD))).astype(np.float32).astype(np.float64)
    p = np_softmax(3 * rng.standard_normal((k_steps, B, T, VD)) + z)
    valid = rng.random((k_steps, B, T)) < 0.9
    n = np.maximum(valid.sum((1, 2)), 1)

    def accepted_of(x):
        return valid & (x.argmax(-1) == p.argmax(-1))

    def f(x):
        w = losses.position_weights("verify", 0.8, list(valid), list(accepted_of(x)))
        ls = [losses.per_position_loss("tv", x[k], jnp.asarray(p[k], jnp.float32)) * valid[k]
              for k in range(k_steps)]
        return losses.weighted_loss(ls, w, jnp.asarray(n, jnp.float32))

    def ref(x):
        w = reference_weights("verify", 0.8, valid, accepted_of(x))
        return sum((w[k] * reference("tv", x[k], p[k]) * valid[k]).sum() / n[k]
                   for k in range(k_steps))

    acc = accepted_of(z)
    assert acc.any() and (valid & ~acc).any()
    x = jnp.asarray(z, jnp.float32)
    np.testing.assert_allclose(float(f(x)), ref(z), rtol=1e-5)
    grad = np.asarray(jax.grad(f)(x))
    want = finite_difference(ref, z)
    np.testing.assert_allclose(grad, want, atol=2e-5 * np.abs(want).max())
