"""Choosing tokens from logits: greedy, temperature, top-k and top-p, and the sampling streams
that belong to requests, not to rows.

Request r's i-th draw uses the key fold_in(fold_in(key(seed), r.seed), i): with the same seed a
request gets the same tokens whichever row it lands in and whoever shares the batch, so
generated data does not depend on the batch size or the order of completion. The plain engine
counts i in generated tokens, the speculative one in generated tokens at each verify step
(each step generates at least one, so no index repeats); greedy decoding needs no key.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class Sampling:
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0  # nucleus: the smallest set of tokens holding this much probability
    top_k: int = 0  # only the k most probable tokens (0: all)

    def __post_init__(self):
        if problem := sampling_problem(self.temperature, self.top_p, self.top_k):
            raise ValueError(problem)


def sampling_problem(temperature: float, top_p: float, top_k: int) -> str | None:
    """What is wrong with these settings, in the command-line options' words (None: nothing);
    the one check of `Sampling` and of the commands, before anything loads."""
    if temperature < 0:
        return f"--temperature {temperature}: must be >= 0 (0 is greedy)"
    if not 0 < top_p <= 1:
        return f"--top-p {top_p}: must be in (0, 1]"
    if top_k < 0:
        return f"--top-k {top_k}: must be >= 0 (0 keeps every token)"
    return None


def sample(logits_BxV: jax.Array, keys_B: jax.Array, sampling: Sampling) -> jax.Array:
    """[B] tokens: argmax at temperature 0, else a draw from softmax(logits / T) over the
    tokens `truncate` keeps."""
    if sampling.temperature == 0:
        return jnp.argmax(logits_BxV, axis=-1).astype(jnp.int32)
    x = truncate(logits_BxV.astype(jnp.float32) / sampling.temperature, sampling.top_k,
                 sampling.top_p)
    return jax.vmap(jax.random.categorical)(keys_B, x).astype(jnp.int32)


def truncate(x_BxV: jax.Array, top_k: int, top_p: float) -> jax.Array:
    """[B, V] fp32 logits x, -inf outside the top_k most probable tokens when top_k > 0 (ties
    with the k-th kept), then outside the top-p nucleus of what is left when top_p < 1: the
    tokens at or above the lowest logit t with mass(x > t) < top_p under softmax(x) (ties
    with t kept; the most probable token always). vLLM's and transformers' order; neither
    sorts the vocabulary."""
    k = min(top_k, x_BxV.shape[-1])
    if k:
        top = jax.lax.top_k(x_BxV, k)[0]  # descending
        x_BxV = jnp.where(x_BxV >= top[:, -1:], x_BxV, -jnp.inf)
    if top_p < 1 and k:
        # The k values are the head of x's descending order (ties with the k-th beyond them
        # lie at its end): their cumulative mass finds t, normalised over all that x keeps.
        p = jnp.exp(top - jax.nn.logsumexp(x_BxV, axis=-1, keepdims=True))
        before = jnp.cumsum(p, axis=-1) - p  # probability of the tokens ranked above
        t = jnp.min(jnp.where(before < top_p, top, jnp.inf), axis=-1, keepdims=True)
        x_BxV = jnp.where(x_BxV >= t, x_BxV, -jnp.inf)
    elif top_p < 1:
        x_BxV = jnp.where(nucleus_mask(x_BxV, top_p), x_BxV, -jnp.inf)
    return x_BxV


def nucleus_mask(x_BxV: jax.Array, top_p: float) -> jax.Array:
    """[B, V] bool: the top-p nucleus of each row of fp32 logits x (-inf: never kept), x >= t
    for the lowest logit t with mass(x > t) < top_p under softmax(x), what a sort finds (ties
    with t and the most probable token kept), found without one.

    mass(x > v) is nonincreasing in v; a bisection finds v*, the lowest float with
    mass(x > v*) < top_p, and v* = t: t qualifies; a float v < t does not, since {x > v} holds
    {x >= t}, which is {x > t'} for the next logit t' below t, and t' does not qualify (t is
    the lowest that does); without a t', {x > v} holds every token (mass 1). So x >= v* is
    x >= t. The bisection runs over fp32's order as int32 keys (`_key`), from -inf's to the
    top logit's, a span under 2**32: 32 halvings leave one key. Each weighs mass(x > v) as one
    masked sum over the vocabulary, in a fixed order and so monotone in the set it sums:
    rounding cannot mislead the search, only decide a boundary whose mass lies within
    rounding of top_p, as the sort's cumulative sum did. On a GPU a halving is one fused pass
    over x."""
    top = jnp.max(x_BxV, axis=-1, keepdims=True)
    budget = top_p * jnp.sum(jnp.exp(x_BxV - top), axis=-1)
    # lo: -inf's key, whose mass (everything) is >= top_p, never weighed; hi: the top logit's,
    # whose mass (nothing) is < top_p
    bounds = jnp.full(top.shape[:1], _key(jnp.float32(-jnp.inf))), _key(top[:, 0])

    def halve(_, carry):
        # x rides in the carry through a barrier, so that XLA cannot compute exp(x - top) once
        # for all halvings: each then reads x alone (one [B, V] fp32 pass), not x and a
        # stored exp (two)
        x, lo, hi = carry
        mid = (lo | hi) - ((lo ^ hi) >> 1)  # ceil((lo + hi) / 2) without int32 overflow
        above = jnp.sum(jnp.where(x > _float(mid)[:, None], jnp.exp(x - top), 0), axis=-1)
        light = above < budget
        return jax.lax.optimization_barrier(x), jnp.where(light, lo, mid), jnp.where(light, mid, hi)

    # unrolled: a GPU runs a while loop from the host, reading its condition back each time
    _, _, hi = jax.lax.fori_loop(0, 32, halve, (x_BxV, *bounds), unroll=True)
    return x_BxV >= _float(hi)[:, None]


def _key(f: jax.Array) -> jax.Array:
    """int32 keys in fp32's order: a float's bits, the 31 below the sign flipped when it is
    set, so that more negative floats count lower (-0.0 just below +0.0)."""
    bits = jax.lax.bitcast_convert_type(f, jnp.int32)
    return jnp.where(bits < 0, bits ^ 0x7FFFFFFF, bits)


def _float(key: jax.Array) -> jax.Array:
    """The float whose `_key` is key (the map is its own inverse on the bits)."""
    return jax.lax.bitcast_convert_type(jnp.where(key < 0, key ^ 0x7FFFFFFF, key), jnp.float32)


def pick(logits_V: jax.Array, key: jax.Array, temperature: float
         ) -> tuple[jax.Array, jax.Array | None]:
    """One token from one row's logits (`sample` at `temperature`) and, above temperature 0,
    the distribution it was drawn from (the draft's q of speculative sampling)."""
    token = sample(logits_V[None], key[None], Sampling(temperature))[0]
    if temperature == 0:
        return token, None
    return token, jax.nn.softmax(logits_V.astype(jnp.float32) / temperature, axis=-1)


def request_keys(base: jax.Array, seeds_B: jax.Array, index_B: jax.Array) -> jax.Array:
    """[B] keys: draw `index` of each request's stream (see the module docstring)."""
    return jax.vmap(lambda s, i: jax.random.fold_in(jax.random.fold_in(base, s), i))(
        seeds_B, index_B)


def is_stop(tokens: jax.Array, stop_ids: jax.Array) -> jax.Array:
    """Whether each token is a stop token (any shape)."""
    return (tokens[..., None] == stop_ids).any(-1)
