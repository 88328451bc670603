"""TTT losses per position and loss weights per step (docs/losses.md says when to use which).

At one position the target's distribution is p (its logits restricted to the draft vocab and
renormalised there, fp32) and the draft's is q = softmax(logits) over the draft vocab, in
fp32. The chance that speculative sampling accepts the draft's token there is their
overlap

    alpha = sum_v min(p_v, q_v) = 1 - TV(p, q)

Losses, each [B, T] from logits [B, T, Vd] and p [B, T, Vd] (rows where p is all zero, the
padding columns, stay finite and are masked by the caller):

    kl         -sum_v p_v log q_v   soft cross-entropy: forward KL(p || q) plus the entropy
               of p, which has no gradient (EAGLE's loss, eagle3kit's default)
    tv         1 - alpha            total variation (LK losses, arXiv 2602.23881)
    nla        -log max(alpha, 1e-5)  negative log-acceptance (LK losses)
    lk-hybrid  lambda KL(p || q) + (1 - lambda)(1 - alpha), lambda = exp(-3 sg(alpha)), the
               weight held constant in the backward pass (sg: stop-gradient), as the LK
               paper's hybrid and speculators' `lk_hybrid` do
    jsd        (KL(p || m) + KL(q || m)) / 2, m = (p + q) / 2

Weights of step k at column t (`position_weights`): `geometric` is decay**k, the same for
every column; `verify` (verification-aware) gives full weight to the steps up to and
including the column's first step whose draft argmax misses the target's, decay**(k - f)
after that first miss f, and then rescales each column so that its weights add up to what
`geometric` gives it. Only the draft's own argmax enters, so no gradient flows through it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
from jax.scipy.special import xlogy

NLA_FLOOR = 1e-5  # alpha below this is held here: -log stays finite (<= 11.5), as speculators
LK_ETA = 3.0  # lambda = exp(-eta alpha): the LK paper's hybrid setting


def soft_cross_entropy(logits_BxTxVd: jax.Array, target_p_BxTxVd: jax.Array) -> jax.Array:
    """-sum_v p log softmax(logits) = lse - sum(p * logits) for a distribution p, in fp32
    -> [B, T].

    Written with the log-sum-exp so XLA fuses it into two reductions over the logits
    instead of writing a [B, T, Vd] log-softmax.
    """
    logits = logits_BxTxVd.astype(jnp.float32)
    return jax.nn.logsumexp(logits, axis=-1) - jnp.sum(target_p_BxTxVd * logits, axis=-1)


def _log_q(logits_BxTxVd: jax.Array) -> jax.Array:
    return jax.nn.log_softmax(logits_BxTxVd.astype(jnp.float32), axis=-1)


def acceptance(logits_BxTxVd: jax.Array, target_p_BxTxVd: jax.Array) -> jax.Array:
    """alpha = sum_v min(p_v, q_v) -> [B, T], in fp32."""
    q = jnp.exp(_log_q(logits_BxTxVd))
    return jnp.sum(jnp.minimum(target_p_BxTxVd, q), axis=-1)


def kl_divergence(logits_BxTxVd: jax.Array, target_p_BxTxVd: jax.Array) -> jax.Array:
    """KL(p || q) = sum_v p_v log p_v - sum_v p_v log q_v -> [B, T] (0 where q = p)."""
    neg_entropy = jnp.sum(xlogy(target_p_BxTxVd, target_p_BxTxVd), axis=-1)
    return soft_cross_entropy(logits_BxTxVd, target_p_BxTxVd) + neg_entropy


def total_variation(logits_BxTxVd: jax.Array, target_p_BxTxVd: jax.Array) -> jax.Array:
    """1 - alpha -> [B, T]."""
    return 1.0 - acceptance(logits_BxTxVd, target_p_BxTxVd)


def neg_log_acceptance(logits_BxTxVd: jax.Array, target_p_BxTxVd: jax.Array) -> jax.Array:
    """-log max(alpha, NLA_FLOOR) -> [B, T]; its gradient is TV's divided by alpha."""
    alpha = acceptance(logits_BxTxVd, target_p_BxTxVd)
    return -jnp.log(jnp.maximum(alpha, NLA_FLOOR))


def lk_hybrid(logits_BxTxVd: jax.Array, target_p_BxTxVd: jax.Array) -> jax.Array:
    """lambda KL + (1 - lambda) TV, lambda = exp(-LK_ETA sg(alpha)) -> [B, T]: KL's strong
    gradient while the draft barely overlaps the target, TV's once it does."""
    alpha = acceptance(logits_BxTxVd, target_p_BxTxVd)
    lam = jnp.exp(-LK_ETA * jax.lax.stop_gradient(alpha))
    return lam * kl_divergence(logits_BxTxVd, target_p_BxTxVd) + (1.0 - lam) * (1.0 - alpha)


def jensen_shannon(logits_BxTxVd: jax.Array, target_p_BxTxVd: jax.Array) -> jax.Array:
    """(KL(p || m) + KL(q || m)) / 2, m = (p + q) / 2 -> [B, T], bounded by log 2.

    log m comes from log-add-exp of log p and log q, so p_v = 0 (an underflowed target
    probability, or a padding row) costs nothing and stays finite in both passes.
    """
    p = target_p_BxTxVd
    log_q = _log_q(logits_BxTxVd)
    log_p = jnp.log(p)  # -inf where p_v = 0: only inside logaddexp and xlogy's x = 0 branch
    log_m = jnp.logaddexp(log_p, log_q) - jnp.log(2.0)
    p_to_m = jnp.sum(xlogy(p, p) - p * log_m, axis=-1)
    q_to_m = jnp.sum(jnp.exp(log_q) * (log_q - log_m), axis=-1)
    return 0.5 * (p_to_m + q_to_m)


LOSSES: dict[str, Callable[[jax.Array, jax.Array], jax.Array]] = {
    "kl": soft_cross_entropy, "tv": total_variation, "nla": neg_log_acceptance,
    "lk-hybrid": lk_hybrid, "jsd": jensen_shannon}


def per_position_loss(name: str, logits_BxTxVd: jax.Array,
                      target_p_BxTxVd: jax.Array) -> jax.Array:
    """The loss `name` (a key of LOSSES) at every position -> [B, T] fp32.

    Under `jax.checkpoint`: the backward pass recomputes q, log q and min(p, q) from the
    logits, one elementwise pass, instead of keeping two to four fp32 [B, T, Vd] tensors of
    every TTT step alive until the backward pass reaches it.
    """
    return jax.checkpoint(LOSSES[name])(logits_BxTxVd, target_p_BxTxVd)


# ---- weights of the K steps -----------------------------------------------------------------

POSITION_WEIGHTS = ("geometric", "verify")


def position_weights(name: str, decay: float, valid_K: Sequence[jax.Array],
                     accepted_K: Sequence[jax.Array]) -> list[float | jax.Array]:
    """Weight of step k at each column: a float (the same for every column) or [B, T] fp32.

    `valid_K[k]` [B, T] bool: step k exists and counts in its step's denominator;
    `accepted_K[k]` [B, T] bool: valid, and the draft's argmax is the target's (what greedy
    verification accepts). `geometric`: decay**k. `verify`, with f the first step not
    accepted (K if none):

        v_k = 1 for k <= f, decay**(k - f) after;   w_k = v_k * S / V

    S = sum_k decay**k valid_k and V = sum_k v_k valid_k over the column's own steps, so each
    column keeps the total weight that `geometric` gives it (a column missed at step 0 gets
    exactly decay**k) and the normaliser needs nothing from other rows: micro-batches and
    devices still add up to the full batch's gradient. No gradient flows into the weights.
    """
    steps = len(valid_K)
    if name == "geometric":
        return [decay ** k for k in range(steps)]
    if name != "verify":
        raise ValueError(f"unknown position weights {name!r}")
    raw, alive, v = [], None, None
    for k in range(steps):
        v = jnp.ones(valid_K[k].shape, jnp.float32) if alive is None else jnp.where(
            alive, 1.0, decay * v)
        raw.append(v)
        alive = accepted_K[k] if alive is None else alive & accepted_K[k]
    valid = [m.astype(jnp.float32) for m in valid_K]
    s = sum(decay ** k * valid[k] for k in range(steps))
    total = sum(raw[k] * valid[k] for k in range(steps))
    scale = jnp.where(total > 0, s / jnp.maximum(total, 1e-30), 0.0)
    return [jax.lax.stop_gradient(r * scale) for r in raw]


def weighted_loss(losses_K: Sequence[jax.Array], weights_K: Sequence[float | jax.Array],
                  denominators_K: jax.Array) -> jax.Array:
    """sum_k sum_t w_k(t) loss_k(t) / n_k, n_k the step's masked-token count over the global
    batch (`ttt.valid_counts`), so accumulation and data parallelism add up exactly. A float
    weight multiplies the step's sum (the geometric loss, bit for bit as it always was)."""
    total = jnp.zeros((), jnp.float32)
    for k, (loss, w) in enumerate(zip(losses_K, weights_K, strict=True)):
        num = w * loss.sum() if isinstance(w, float) else jnp.sum(w * loss)
        total = total + num / jnp.maximum(denominators_K[k], 1.0)
    return total
