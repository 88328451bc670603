"""Batched generation with the target alone: fixed cache rows, continuous refill.

The engine decodes up to C sequences at once. Its KV cache holds C independent rows of S
positions each (`target.forward_rows`): a row's keys sit at their own RoPE positions, so every
row has its own length, and a row that finishes takes the next pending request at once, with
programs compiled once per shape:

    prefill   P new prompts (padded to a bucket of P rows x T tokens) start in free rows: one
              forward writes their keys and samples each one's first token. Prompts longer than
              `prefill_chunk` are prefilled in pieces that read the keys written before.
    decode    up to `sync_every` steps of all C rows in one device program (a while loop):
              each step feeds every row its newest token and samples the next. Finished and
              free rows idle (they write nothing a live query can read). The program ends
              early once no row is live, or once a row finished while requests wait, so no
              step is run for nothing and no request waits on idle rows: the plain baseline
              of `eval --concurrency` does exactly the useful work, as the speculative engine
              does. The host syncs once per program, collects the tokens, retires finished
              rows and refills them.

Attention reads only the first `window` positions of each row, a bound over the longest live
sequence (`window_bucket`), so short sequences never pay for the cache's full length. Layers
are looped over unstacked (`target.LayerList`): scanning the stacked layers would copy each
layer's weights and cache out of the stack at every step.

Repetition (`EngineConfig.repetition`, decode/repetition.py): where the tokens of a decode
program come back to the host, an answer whose tail repeats one block is ended at the token
that completed the loop ("repetition"), as if checked after every token. The host frees the
row at once; on the device it runs on unread until a prefill takes it (its writes stay in its
own row), so no program changes.

Sampling is per request, not per row: request r's token i is drawn with the key
fold_in(fold_in(key(seed), r.seed), i). With the same seed a request gets the same tokens
whichever row it lands in and whoever shares the batch, so regenerated data does not depend
on the batch size or the order of completion (greedy decoding needs no key at all).

Shapes: C cache rows, S positions per row, P prefill rows, T prefill tokens, V target vocab.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding

from eagle3kit.core import target
from eagle3kit.core.config import TargetConfig
from eagle3kit.core.sharding import batch_ways, spec_for, use_mesh
from eagle3kit.decode.repetition import Detector, Repetition
from eagle3kit.errors import ResourceError

MIN_PREFILL = 128  # shortest prefill bucket (tokens), unless prefill_chunk is shorter
MIN_WINDOW = 128  # shortest attention window (positions)


@dataclasses.dataclass(frozen=True)
class Sampling:
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0  # nucleus: the smallest set of tokens holding this much probability
    top_k: int = 0  # only the k most probable tokens (0: all)

    def __post_init__(self):
        if self.temperature < 0:
            raise ValueError(f"temperature {self.temperature} < 0")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p {self.top_p} outside (0, 1]")
        if self.top_k < 0:
            raise ValueError(f"top_k {self.top_k} < 0")


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    rows: int = 64  # C: sequences decoded at once
    max_context: int = 4096  # S: prompt + answer, per row
    sync_every: int = 32  # decode steps per device program (host syncs)
    prefill_chunk: int = 512  # longest prefill piece
    sampling: Sampling = Sampling()
    seed: int = 0
    repetition: Repetition | None = None  # end answers that loop (None: never)


@dataclasses.dataclass
class Request:
    handle: Any  # the caller's, returned with the completion
    prompt: Sequence[int]
    max_new_tokens: int
    seed: int = 0  # this request's sampling stream (see the module docstring)


@dataclasses.dataclass
class Completion:
    handle: Any
    prompt_len: int
    tokens: list[int]  # generated, ending with the stop token when one ended it
    finish_reason: str  # "stop" (a stop token), "length" (max_new_tokens reached) or
    # "repetition" (its last tokens repeat one block: EngineConfig.repetition)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class RowState:
    """Per cache row (device arrays, [C] each)."""

    token: Any  # int32: the newest token, fed at the next step
    position: Any  # int32: where that token's keys go
    generated: Any  # int32: tokens generated so far
    limit: Any  # int32: max new tokens of the row's request
    seed: Any  # uint32: the request's sampling stream
    active: Any  # bool

    @staticmethod
    def empty(c: int) -> RowState:
        z = jnp.zeros((c,), jnp.int32)
        return RowState(z, z, z, z, jnp.zeros((c,), jnp.uint32), jnp.zeros((c,), bool))


def bucket(n: int, low: int) -> int:
    """The next power of two >= n, at least `low`."""
    return max(low, 1 << (max(n, 1) - 1).bit_length())


def window_bucket(n: int, limit: int) -> int:
    """Cache positions attention reads: the next of 128, 192, 256, 384, 512, 768, ... (powers
    of two and 1.5x them: at most a third more than needed, few programs), at most `limit`."""
    w = MIN_WINDOW
    while w < n:
        w = w * 3 // 2 if w & (w - 1) == 0 else w // 3 * 4
    return min(w, limit)


def _rows_bucket(n: int, low: int) -> int:
    """Prefill rows: `low` times a power of four >= n (few programs; the engine sets `low` to
    a sixteenth of its rows, so a refill of one row pads to 1/16 of a full prefill)."""
    p = max(low, 1)
    while p < n:
        p *= 4
    return p


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


def _keys(base: jax.Array, seeds_B: jax.Array, index_B: jax.Array) -> jax.Array:
    return jax.vmap(lambda s, i: jax.random.fold_in(jax.random.fold_in(base, s), i))(
        seeds_B, index_B)


def _logits(w: target.TargetWeights, hidden_BxD: jax.Array) -> jax.Array:
    """fp32 logits: 16-bit logits tie at the top often enough to change greedy answers."""
    return jnp.einsum("bd,dv->bv", hidden_BxD, target.lm_head_weight(w),
                      preferred_element_type=jnp.float32)


def _is_stop(tokens_B: jax.Array, stop_ids: jax.Array) -> jax.Array:
    return (tokens_B[:, None] == stop_ids[None, :]).any(-1)


def _prefill(w, cache, state, base_key, stop_ids, tokens_PxT, rows_P, starts_P, lengths_P,
             limits_P, seeds_P, *, cfg: TargetConfig, sampling: Sampling, first: bool,
             window: int):
    """One prefill piece for P rows; rows whose prompt ends in it get their first token.

    Padding rows carry row index C (out of range): their writes are dropped.
    """
    p, t = tokens_PxT.shape
    positions = starts_P[:, None] + jnp.arange(t)[None, :]
    hidden, cache = target.forward_rows(w, cfg, tokens_PxT, positions, cache, rows_B=rows_P,
                                        window=window, prefill=first)
    last = jnp.clip(lengths_P - 1 - starts_P, 0, t - 1)
    hidden = jnp.take_along_axis(hidden, last[:, None, None], axis=1)[:, 0]
    token = sample(_logits(w, hidden), _keys(base_key, seeds_P, jnp.zeros_like(seeds_P)),
                   sampling)
    ends = starts_P + t >= lengths_P
    active = ends & ~_is_stop(token, stop_ids) & (limits_P > 1)

    def put(field, value):
        return field.at[rows_P].set(value.astype(field.dtype), mode="drop")

    state = RowState(put(state.token, token), put(state.position, lengths_P),
                     put(state.generated, jnp.ones_like(token)), put(state.limit, limits_P),
                     put(state.seed, seeds_P), put(state.active, active))
    return cache, state, token


def run_steps(body, carry: tuple, steps: int, waiting, state_at: int) -> tuple:
    """`body(i, carry) -> carry` for i = 0, 1, ... while fewer than `steps` ran, a row is still
    live, and no row live at the start has finished while `waiting` (requests queued for it):
    both engines' device programs, so no step runs for nothing and a freed row is refilled
    at once. `carry[state_at]` is the rows' state (its `active` [C]); returns (steps run,
    *carry)."""
    live_at_start = carry[state_at].active

    def more(c):
        active = c[1 + state_at].active
        return (c[0] < steps) & active.any() & ~(waiting & (live_at_start & ~active).any())

    return jax.lax.while_loop(more, lambda c: (c[0] + 1, *body(c[0], c[1:])), (0, *carry))


def _decode(w, cache, state, base_key, stop_ids, waiting, *, cfg: TargetConfig,
            sampling: Sampling, steps: int, window: int):
    """Up to `steps` decoding steps of every row -> (cache, state, tokens [C, steps], -1 where
    a row emitted nothing, steps run). It stops early once no row is live, or once a row
    finished while `waiting` (requests are queued for a free row)."""
    c = state.token.shape[0]

    def body(i, carry):
        cache, s, out = carry
        hidden, cache = target.forward_rows(w, cfg, s.token[:, None], s.position[:, None],
                                            cache, window=window)
        token = sample(_logits(w, hidden[:, 0]), _keys(base_key, s.seed, s.generated),
                       sampling)
        out = out.at[:, i].set(jnp.where(s.active, token, -1))
        live = s.active.astype(jnp.int32)
        generated = s.generated + live
        s = RowState(jnp.where(s.active, token, s.token), s.position + live, generated,
                     s.limit, s.seed,
                     s.active & ~_is_stop(token, stop_ids) & (generated < s.limit))
        return cache, s, out

    out = jnp.full((c, steps), -1, jnp.int32)
    ran, cache, state, out = run_steps(body, (cache, state, out), steps, waiting, state_at=1)
    return cache, state, out, ran


@functools.cache
def _programs(tcfg: TargetConfig, sampling: Sampling):
    """The jitted prefill and decode of one target and sampling rule, shared by every engine
    of the process (an eval after a regenerate, tests) so each shape compiles once."""
    prefill = jax.jit(functools.partial(_prefill, cfg=tcfg, sampling=sampling),
                      static_argnames=("first", "window"), donate_argnums=(1, 2))
    decode = jax.jit(functools.partial(_decode, cfg=tcfg, sampling=sampling),
                     static_argnames=("steps", "window"), donate_argnums=(1, 2))
    return prefill, decode


@dataclasses.dataclass
class _Row:
    request: Request
    tokens: list[int]
    remaining_prompt: int  # prompt tokens not yet prefilled (long prompts go in pieces)


class Engine:
    """Continuous batched generation of one target (see the module docstring).

    `step(queue)` takes requests from the left of `queue` into free rows, advances every live
    row by up to `sync_every` tokens and returns the requests that finished.
    """

    def __init__(self, tcfg: TargetConfig, weights: target.TargetWeights, mesh: Mesh,
                 stop_ids: Sequence[int], cfg: EngineConfig):
        data = batch_ways(mesh)
        if cfg.rows % data:
            raise ResourceError(f"{cfg.rows} rows cannot be split over data={data} devices; "
                                "use a multiple of the data axis")
        if cfg.prefill_chunk & (cfg.prefill_chunk - 1) or cfg.prefill_chunk < 16:
            raise ValueError(f"prefill_chunk {cfg.prefill_chunk}: a power of two >= 16")
        self.tcfg, self.mesh, self.cfg = tcfg, mesh, cfg
        # per-layer weights: see target.LayerList (the caller may drop the stacked ones, or
        # pass a LayerList it made with target.unstack_in_place)
        self.w = weights if isinstance(weights, target.LayerList) else \
            jax.jit(target.unstack, static_argnums=1)(weights, tcfg)
        self.stop_ids = jnp.asarray(sorted(set(stop_ids)) or [-1], jnp.int32)
        self._stops = set(int(s) for s in stop_ids)  # the host's copy, for _emit
        self.base_key = jax.random.key(cfg.seed)
        self.rows: list[_Row | None] = [None] * cfg.rows
        self.generated_tokens = 0
        self.decode_steps = 0  # decode steps run (each advances every live row by a token)
        self.programs: set[tuple] = set()  # compiled shapes, for reporting
        dtype = weights.embed.dtype
        cache_spec = NamedSharding(mesh, spec_for(("batch", None, "act_heads", None)))
        row_spec = NamedSharding(mesh, spec_for(("batch",)))
        shape = (tcfg.num_layers, cfg.rows, cfg.max_context, tcfg.num_kv_heads, tcfg.head_dim)
        self.cache_bytes = 2 * int(np.prod(shape)) * jnp.dtype(dtype).itemsize
        _check_memory(self.cache_bytes, mesh, cfg)
        layers = [cache_spec] * tcfg.num_layers
        with use_mesh(mesh):
            self.cache = jax.jit(lambda: target.RowCache.zeros(tcfg, cfg.rows, cfg.max_context,
                                                               dtype),
                                 out_shardings=target.RowCache(layers, layers))()
            self.state = jax.jit(lambda: RowState.empty(cfg.rows),
                                 out_shardings=jax.tree.map(lambda _: row_spec,
                                                            RowState.empty(1)))()
        self._prefill, self._decode = _programs(tcfg, cfg.sampling)
        self._repeats = cfg.repetition and Detector(cfg.repetition, cfg.rows)

    # ---- host side --------------------------------------------------------------------------

    @property
    def busy(self) -> bool:
        return any(r is not None for r in self.rows)

    @property
    def free_rows(self) -> int:
        return sum(r is None for r in self.rows)

    def step(self, queue: collections.deque[Request]) -> list[Completion]:
        """Admits requests from the left of `queue` into free rows, prefills them, runs one
        decode program if any row is live; returns the completions, in row order."""
        done: list[Completion] = []
        admitted = []
        for i, row in enumerate(self.rows):
            if row is None and queue:
                request = queue.popleft()
                self._check(request)
                self.rows[i] = _Row(request, [], len(request.prompt))
                admitted.append(i)
                if self._repeats:
                    self._repeats.reset(i)
        if admitted:
            done += self._prefill_rows(admitted)
        if any(r is not None and r.remaining_prompt == 0 for r in self.rows):
            done += self._decode_rows(waiting=bool(queue))
        return done

    def _check(self, r: Request) -> None:
        if not r.prompt:
            raise ValueError(f"request {r.handle!r}: empty prompt")
        if not 1 <= r.max_new_tokens <= self.cfg.max_context - len(r.prompt):
            raise ValueError(f"request {r.handle!r}: {len(r.prompt)} prompt tokens + "
                             f"{r.max_new_tokens} new do not fit {self.cfg.max_context}")

    def _prefill_rows(self, rows: list[int]) -> list[Completion]:
        done = []
        while rows:
            # every admitted row's next piece; rows with a longer prompt come back for more
            start = {i: len(self.rows[i].request.prompt) - self.rows[i].remaining_prompt
                     for i in rows}
            groups: dict[tuple[bool, int, int], list[int]] = collections.defaultdict(list)
            for i in rows:
                piece = min(self.rows[i].remaining_prompt, self.cfg.prefill_chunk)
                # few shapes (each is a compiled program): 128-token pieces and up, and later
                # pieces of long prompts read the whole row
                t = bucket(piece, min(MIN_PREFILL, self.cfg.prefill_chunk))
                first = start[i] == 0
                window = 0 if first else self.cfg.max_context
                groups[(first, t, window)].append(i)
            for (first, t, window), members in sorted(groups.items()):
                done += self._prefill_group(members, start, first, t, window)
            rows = [i for i in rows if self.rows[i] is not None
                    and self.rows[i].remaining_prompt > 0]
        return done

    def _prefill_group(self, members, start, first, t, window) -> list[Completion]:
        c = self.cfg.rows
        p = min(_rows_bucket(len(members), max(batch_ways(self.mesh), c // 16)), c)
        tokens = np.zeros((p, t), np.int32)
        rows = np.full((p,), c, np.int32)  # padding rows write nowhere
        starts, lengths = np.zeros((p,), np.int32), np.ones((p,), np.int32)
        limits, seeds = np.ones((p,), np.int32), np.zeros((p,), np.uint32)
        for j, i in enumerate(members):
            r = self.rows[i].request
            piece = list(r.prompt[start[i]: start[i] + t])
            tokens[j, : len(piece)] = piece
            rows[j], starts[j], lengths[j] = i, start[i], len(r.prompt)
            limits[j], seeds[j] = r.max_new_tokens, np.uint32(r.seed & 0xFFFFFFFF)
        self.programs.add(("prefill", p, t, window))
        with use_mesh(self.mesh):
            self.cache, self.state, first_tokens = self._prefill(
                self.w, self.cache, self.state, self.base_key, self.stop_ids,
                jnp.asarray(tokens), jnp.asarray(rows), jnp.asarray(starts),
                jnp.asarray(lengths), jnp.asarray(limits), jnp.asarray(seeds),
                first=first, window=window or t)
        first_tokens = np.asarray(jax.device_get(first_tokens))
        started = {}
        for j, i in enumerate(members):
            row = self.rows[i]
            row.remaining_prompt = max(0, len(row.request.prompt) - start[i] - t)
            if row.remaining_prompt == 0:
                started[i] = [int(first_tokens[j])]
        return self._emit_rows(started)

    def _decode_rows(self, waiting: bool) -> list[Completion]:
        steps = self.cfg.sync_every
        longest = max(len(r.request.prompt) + len(r.tokens) for r in self.rows
                      if r is not None and r.remaining_prompt == 0)
        window = window_bucket(longest + steps, self.cfg.max_context)
        self.programs.add(("decode", self.cfg.rows, steps, window))
        with use_mesh(self.mesh):
            self.cache, self.state, out, ran = self._decode(
                self.w, self.cache, self.state, self.base_key, self.stop_ids,
                jnp.asarray(waiting), steps=steps, window=window)
        out, ran = jax.device_get((out, ran))
        self.decode_steps += int(ran)
        out = np.asarray(out)
        return self._emit_rows({i: [int(x) for x in out[i] if x >= 0]
                                for i, row in enumerate(self.rows)
                                if row is not None and row.remaining_prompt == 0})

    def _emit_rows(self, new: dict[int, list[int]]) -> list[Completion]:
        """Each row's new tokens, cut after a repetition when one completed among them."""
        loops = [None] * len(new)
        k = max(map(len, new.values()), default=0)  # a row with fewer tokens has finished
        if self._repeats and k:
            loops = self._repeats.feed(list(new), [t + [-1] * (k - len(t))
                                                   for t in new.values()])
        done = []
        for (i, tokens), loop in zip(new.items(), loops, strict=True):
            done += self._emit(i, tokens, loop)
        return done

    def _emit(self, i: int, tokens: list[int], loop: int | None = None) -> list[Completion]:
        """Appends a row's new tokens; retires it when a stop token or its limit ends it (the
        device applied the same rule, so the row is already idle there), or at the `loop`-th
        token, which completed a repetition."""
        row = self.rows[i]
        for n, tok in enumerate(tokens, start=1):
            row.tokens.append(tok)
            self.generated_tokens += 1
            stopped = tok in self._stops
            if stopped or len(row.tokens) >= row.request.max_new_tokens or n == loop:
                self.rows[i] = None
                reason = "stop" if stopped else "repetition" if n == loop else "length"
                return [Completion(row.request.handle, len(row.request.prompt), row.tokens,
                                   reason)]
        return []

    def generate(self, requests: Sequence[Request]) -> list[Completion]:
        """Every request to completion; completions in the order of `requests`."""
        return run_to_completion(self, requests)


def run_to_completion(engine, requests: Sequence[Request]) -> list:
    """Feeds `requests` to an engine's `step(queue)` until it is idle (`busy` false); the
    completions in the order of `requests`. Both engines (plain and speculative) use it."""
    queue = collections.deque(requests)
    by_handle: dict[Any, Completion] = {}
    while queue or engine.busy:
        for c in engine.step(queue):
            by_handle[c.handle] = c
    return [by_handle[r.handle] for r in requests]


def _check_memory(cache_bytes: int, mesh: Mesh, cfg: EngineConfig) -> None:
    """Refuses a cache that cannot fit, before allocating it (GPU/TPU report their limit)."""
    stats = mesh.devices.flat[0].memory_stats() or {}
    limit = stats.get("bytes_limit")
    per_device = cache_bytes / mesh.devices.size
    if limit and per_device > 0.9 * (limit - stats.get("bytes_in_use", 0)):
        raise ResourceError(
            f"the KV cache of {cfg.rows} rows x {cfg.max_context} positions needs "
            f"{per_device / 2**30:.1f} GiB per device, more than is free "
            f"({(limit - stats.get('bytes_in_use', 0)) / 2**30:.1f} GiB); lower --slots or "
            "--max-context")
