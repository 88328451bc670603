"""Host side of decoding: prompt buckets, ahead-of-time compilation, timing, results.

Prompts are padded to power-of-two buckets, so a prompt set compiles a handful of programs.
`Decoder.prepare` compiles the speculative and the plain loop for a bucket (by a run that stops
after the prefill) before anything is timed; each timed call is one device program from prefill to the last token, so tokens/s
counts the device's work and one host round trip per prompt, for both loops alike.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import time
from collections.abc import Iterable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from eagle3kit.core.config import DraftConfig, TargetConfig
from eagle3kit.core.sharding import use_mesh
from eagle3kit.core.ttt import VocabArrays
from eagle3kit.decode.speculative import DecodeConfig, plain_generate, speculative_generate

MIN_BUCKET = 128  # most chat prompts: one program for all of them


@dataclasses.dataclass
class Result:
    """One decoded prompt, on the host."""

    generated_ids: list[int]  # up to and including a stop token, at most max_new_tokens
    accept_lengths: list[int]  # draft tokens accepted per verify step (speculative only)
    seconds: float  # wall time of the device program (compiled beforehand)
    forwards: int  # target forwards after the prefill


def bucket(length: int) -> int:
    """The padded prompt length: the next power of two, at least MIN_BUCKET."""
    return max(MIN_BUCKET, 1 << (max(length, 1) - 1).bit_length())


@functools.cache
def _jitted(kind: str, tcfg: TargetConfig, dcfg: DraftConfig, dec: DecodeConfig,
            cache_len: int):
    """One jitted loop per configuration, shared by every `Decoder` of the process, so
    decoders of equal configs (tests, a benchmark's repeats) compile once per bucket."""
    if kind == "speculative":
        return jax.jit(functools.partial(speculative_generate, tcfg=tcfg, dcfg=dcfg, dec=dec,
                                         cache_len=cache_len))
    plain = functools.partial(plain_generate, tcfg=tcfg, dec=dec, cache_len=cache_len,
                              aux_layer_ids=dcfg.aux_layer_ids)
    return jax.jit(lambda target_w, draft_w, vocab, *rest: plain(target_w, *rest))


class Decoder:
    """Speculative and plain decoding of one target/draft pair, compiled per prompt bucket."""

    def __init__(self, tcfg: TargetConfig, dcfg: DraftConfig, target_w: Any, draft_w: Any,
                 vocab: VocabArrays, dec: DecodeConfig, stop_ids: Sequence[int], mesh: Mesh):
        dec.check()
        self.tcfg, self.dcfg, self.dec, self.mesh = tcfg, dcfg, dec, mesh
        self.target_w, self.draft_w, self.vocab = target_w, draft_w, vocab
        self.stop_ids = jnp.asarray(list(stop_ids) or [-1], jnp.int32)
        self._ready: set[int] = set()

    def with_draft(self, draft_w: Any) -> Decoder:
        """The same decoder (and compiled programs) with other draft weights of equal shapes."""
        other = copy.copy(self)
        other.draft_w = draft_w
        return other

    def cache_len(self, padded: int) -> int:
        # every write stays inside: the last verify starts below prompt + max_new - 1 and
        # writes max(K+1, N) tokens; a multiple of 128 keeps the attention shapes friendly
        need = padded + self.dec.max_new_tokens + max(self.dec.steps, self.dec.nodes) + 2
        return -(-need // 128) * 128

    def _call(self, kind: str, prompt: Sequence[int], limit: int, seed: int):
        padded = bucket(len(prompt))
        p = np.zeros(padded, np.int32)
        p[: len(prompt)] = prompt
        fn = _jitted(kind, self.tcfg, self.dcfg, self.dec, self.cache_len(padded))
        args = (self.target_w, self.draft_w, self.vocab, jnp.asarray(p),
                jnp.int32(len(prompt)), jnp.int32(limit), self.stop_ids, jax.random.key(seed))
        jax.block_until_ready(args)
        with use_mesh(self.mesh):
            t0 = time.perf_counter()
            out = jax.block_until_ready(fn(*args))
        return out, time.perf_counter() - t0

    def prepare(self, prompt_len: int) -> float:
        """Compiles both loops for the bucket of `prompt_len` (a run that stops after the
        prefill); returns the seconds it took, 0 when already done."""
        padded = bucket(prompt_len)
        if padded in self._ready:
            return 0.0
        t0 = time.perf_counter()
        for kind in ("speculative", "plain"):
            self._call(kind, [0] * prompt_len, 1, 0)
        self._ready.add(padded)
        return time.perf_counter() - t0

    def _run(self, kind: str, prompt: Sequence[int], seed: int, limit: int | None) -> Result:
        limit = self.dec.max_new_tokens if limit is None else limit
        if not 1 <= limit <= self.dec.max_new_tokens:
            raise ValueError(f"limit {limit} outside 1..{self.dec.max_new_tokens}")
        self.prepare(len(prompt))
        out, seconds = self._call(kind, prompt, limit, seed)
        out = jax.device_get(out)
        generated = [int(t) for t in out.tokens[len(prompt): int(out.length)]]
        generated = _truncate(generated, set(int(s) for s in self.stop_ids), limit)
        steps = int(out.verify_steps)
        accepted = [int(a) for a in out.accepted[:steps]] if kind == "speculative" else []
        return Result(generated, accepted, seconds, steps)

    def speculative(self, prompt: Sequence[int], seed: int = 0, limit: int | None = None
                    ) -> Result:
        """Speculative decoding of `prompt` (token ids) until a stop token or `limit` new
        tokens (default and at most dec.max_new_tokens; the compiled program is the same)."""
        return self._run("speculative", prompt, seed, limit)

    def plain(self, prompt: Sequence[int], seed: int = 0, limit: int | None = None) -> Result:
        """Plain decoding of the target alone, as `speculative`."""
        return self._run("plain", prompt, seed, limit)


def _truncate(ids: list[int], stops: set[int], limit: int) -> list[int]:
    for i, t in enumerate(ids):
        if t in stops:
            return ids[: min(i + 1, limit)]
    return ids[:limit]


def acceptance_summary(accept_lengths: Iterable[Sequence[int]], steps: int) -> dict[str, Any]:
    """Generation acceptance from the accepted draft counts of every verify step, per request.

    A verify step that accepts a draft tokens emits a + 1 (the target's own bonus token
    always counts; the prefill's first token is no verify step and does not). tau is then
    reported both ways the engines do:

        tau_pooled            sum over all verify steps of (a + 1) / number of verify steps
                              (long answers weigh more; what a server's counters report)
        tau_per_request_mean  the mean over requests of each request's own pooled tau
                              (requests without a verify step have none and are left out)

    accept_rate[j-1] is the share of verify steps that accepted draft token j among those
    that accepted tokens 1..j-1 (conditional, like cond_acc), so tau_pooled =
    1 + sum_j prod_{i<=j} accept_rate_i. `tau_generate` is tau_pooled under its older name.
    """
    per_request = [np.asarray(x, np.int64) for x in accept_lengths]
    a = np.concatenate([np.zeros(0, np.int64), *per_request])
    reached = np.asarray([(a >= j - 1).sum() for j in range(1, steps + 1)], np.float64)
    taken = np.asarray([(a >= j).sum() for j in range(1, steps + 1)], np.float64)
    rate = np.where(reached > 0, taken / np.maximum(reached, 1), 0.0)
    pooled = float((a + 1).mean()) if len(a) else 0.0
    taus = [float((r + 1).mean()) for r in per_request if len(r)]
    return {
        "tau_generate": round(pooled, 6),
        "tau_pooled": round(pooled, 6),
        "tau_per_request_mean": round(float(np.mean(taus)), 6) if taus else 0.0,
        "accept_rate": [round(float(r), 6) for r in rate],
        "verify_steps": int(len(a)),
        "accept_histogram": np.bincount(a, minlength=steps + 1).tolist(),
    }
