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
    """[B] tokens: argmax at temperature 0, else a draw from softmax(logits / T), restricted
    to the top_k most probable tokens when top_k > 0 (ties with the k-th kept), then to the
    top-p nucleus of what is left when top_p < 1 (the most probable token is always kept).
    vLLM's and transformers' order; top-k alone costs no sort of the vocabulary."""
    if sampling.temperature == 0:
        return jnp.argmax(logits_BxV, axis=-1).astype(jnp.int32)
    x = logits_BxV.astype(jnp.float32) / sampling.temperature
    k = min(sampling.top_k, x.shape[-1])
    if k:
        top = jax.lax.top_k(x, k)[0]  # descending
        x = jnp.where(x >= top[:, -1:], x, -jnp.inf)
    if sampling.top_p < 1:
        desc = top if k else -jnp.sort(-x, axis=-1)
        p = jax.nn.softmax(desc, axis=-1)
        before = jnp.cumsum(p, axis=-1) - p  # probability of the tokens ranked above
        keep = before < sampling.top_p
        threshold = jnp.min(jnp.where(keep, desc, jnp.inf), axis=-1, keepdims=True)
        x = jnp.where(x >= threshold, x, -jnp.inf)
    return jax.vmap(jax.random.categorical)(keys_B, x).astype(jnp.int32)


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
