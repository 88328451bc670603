"""Batched speculative decoding with continuous refill: C rows, each its own request.

The batch-1 loop of decode/speculative.py is a function of one row's state: its target KV
cache, its draft cache, its newest token x_n at position n, the draft's h of column n-1. This
engine keeps that state for C rows at once ([C, ...] arrays, rows over the mesh's `data`
axis) and `vmap`s the very same per-row functions over the rows, so every row of a verify
step is exactly the batch-1 step, at its own positions, with its own mask:

    prefill   P new prompts (padded to P rows x T tokens) start in free rows: the target's
              forward over each prompt, its first token, the draft's step-0 entries of the
              prompt, all written over the row's previous contents (n, caches, stream).
    verify    up to `sync_every` verify steps of all C rows in one device program (a while
              loop that ends early, as the plain engine's does, once no row is live or once a
              row finished while requests wait):
              each live row drafts (chain: K tokens; tree: S steps of top-k, N nodes), the
              target verifies every row's K+1 (or N) tokens in ONE batched forward, each
              row's acceptance rule (`_verify_chain` / `_verify_tree` of speculative.py, pure
              per row) picks its accepted tokens and bonus, the accepted keys are committed
              (trees: moved to contiguous slots) and the draft cache extended.
              Rows that finished idle: their state is frozen, their cache writes land past
              everything their request read and are overwritten by the next prefill.

The host syncs once per program: it collects each row's accepted tokens, retires the rows
that hit a stop token or their limit and refills them from the queue; programs are compiled
once per shape (P x T prefill buckets, one verify program).

Sampling streams are per request: request r's verify step i uses fold_in(key(r.seed), i),
exactly as `speculative_generate` does for batch 1, so a request's tokens do not depend on
its row or on who shares the batch.

Shapes: C rows, S cache slots per row, P prefill rows, T prefill tokens, K draft tokens per
step, L layers, D hidden.
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
from eagle3kit.core.config import DraftConfig, TargetConfig
from eagle3kit.core.sharding import RULES, batch_ways, spec_for, use_mesh
from eagle3kit.core.ttt import VocabArrays
from eagle3kit.decode import draft_cache, speculative
from eagle3kit.decode.engine import (
    Completion,
    Request,
    _rows_bucket,
    run_steps,
    run_to_completion,
    window_bucket,
)
from eagle3kit.decode.runner import _truncate, bucket
from eagle3kit.decode.speculative import DecodeConfig
from eagle3kit.errors import ResourceError


@dataclasses.dataclass(frozen=True)
class SpecEngineConfig:
    rows: int = 8  # C: requests decoded at once
    max_context: int = 2048  # S: prompt + answer + one verify's tokens, per row
    sync_every: int = 8  # verify steps per device program (host syncs)


@dataclasses.dataclass
class SpecCompletion(Completion):
    accept_lengths: list[int] = dataclasses.field(default_factory=list)  # per verify step


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class SpecRows:
    """Per row (device arrays with a leading [C])."""

    tcache: target.KVCache  # k, v [C, L, 1, S, Kv, H]
    dcache: draft_cache.DraftKV  # k, v [C, 1, S, Kd, H]
    token: Any  # int32: x_n, the newest token (the next verify's root)
    n: Any  # int32: x_n's position
    prompt_len: Any  # int32
    limit: Any  # int32: max new tokens
    h_last: Any  # [C, 1, 1, D]: the draft's h of column n-1
    key: Any  # uint32 key data: the request's verify stream
    steps: Any  # int32: verify steps taken by the request
    active: Any  # bool


# ---- one row (pure; vmapped over the rows) -------------------------------------------------


def _start_row(target_w, draft_w, vocab, prompt_T, m, limit, key_data, stop_ids, *,
               tcfg: TargetConfig, dcfg: DraftConfig, temperature: float, slots: int):
    """A row's state after its prompt (`prompt_T` padded, first `m` real) and its first
    token, as `speculative_generate` starts: fresh caches, position m, step 0."""
    key, prefill_key = jax.random.split(jax.random.wrap_key_data(key_data))
    out, tcache, first = speculative._prefill(target_w, tcfg, dcfg.aux_layer_ids, prompt_T, m,
                                              slots, prefill_key, temperature)
    next_tokens = jnp.roll(prompt_T, -1).at[m - 1].set(first)
    dcache = draft_cache.DraftKV.zeros(dcfg, 1, slots, draft_w.fc.dtype)
    h, dcache = draft_cache.extend(draft_w, dcfg, target_w, out.aux_BxTxA, next_tokens[None],
                                   jnp.int32(0), dcache)
    h_last = jax.lax.dynamic_slice_in_dim(h, m - 1, 1, axis=1)
    active = ~speculative._stopped(first[None], 1, stop_ids) & (limit > 1)
    row = SpecRows(tcache, dcache, first, m, m, limit, h_last, jax.random.key_data(key),
                   jnp.int32(0), active)
    return row, first


def _step_row(target_w, draft_w, vocab, row: SpecRows, stop_ids, *, tcfg: TargetConfig,
              dcfg: DraftConfig, dec: DecodeConfig):
    """One verify step of one row -> (row, new tokens [K+1] (-1 past the accepted ones and
    on an idle row), accepted count (-1 on an idle row))."""
    verify = speculative._verify_tree if dec.is_tree else speculative._verify_chain
    key = jax.random.fold_in(jax.random.wrap_key_data(row.key), row.steps)
    new, a, out, tcache, dcache = verify(target_w, draft_w, vocab, row.token, row.h_last,
                                         row.n, row.tcache, row.dcache, key, tcfg=tcfg,
                                         dcfg=dcfg, dec=dec)
    # new[j] is x_{n+j+1}, the token column n+j reads; columns past a are never read
    h, dcache = draft_cache.extend(draft_w, dcfg, target_w, out.aux_BxTxA, new[None], row.n,
                                   dcache)
    n = row.n + a + 1
    done = speculative._stopped(new, a + 1, stop_ids) | (n + 1 - row.prompt_len >= row.limit)
    live = row.active

    def keep(stepped, old):
        return jnp.where(live, stepped, old)

    row = SpecRows(tcache, dcache, keep(new[a], row.token), keep(n, row.n), row.prompt_len,
                   row.limit, keep(jax.lax.dynamic_slice_in_dim(h, a, 1, axis=1), row.h_last),
                   row.key, row.steps + live.astype(jnp.int32), live & ~done)
    shown = jnp.where(live & (jnp.arange(new.shape[0]) <= a), new, -1)
    return row, shown, jnp.where(live, a, -1)


# ---- the device programs -------------------------------------------------------------------


def _vmap(f, mesh_data: int):
    # the row axis over `data` inside the vmapped per-row code too
    return jax.vmap(f, spmd_axis_name=RULES["batch"] if mesh_data > 1 else None)


def _prefill(target_w, draft_w, vocab, state: SpecRows, stop_ids, prompts_PxT, lengths_P,
             limits_P, keys_P, rows_P, *, tcfg, dcfg, temperature, slots, data):
    """Starts P rows (padding rows carry row index C: their writes are dropped)."""
    start = functools.partial(_start_row, tcfg=tcfg, dcfg=dcfg, temperature=temperature,
                              slots=slots)
    new, first = _vmap(lambda p, m, lim, k: start(target_w, draft_w, vocab, p, m, lim, k,
                                                  stop_ids), data)(
        prompts_PxT, lengths_P, limits_P, keys_P)
    state = jax.tree.map(lambda old, x: old.at[rows_P].set(x.astype(old.dtype), mode="drop"),
                         state, new)
    return state, first, new.active


def _verify(target_w, draft_w, vocab, state: SpecRows, stop_ids, waiting, *, tcfg, dcfg, dec,
            steps, window, data):
    """Up to `steps` verify steps of every row -> (state, tokens [C, steps, K+1], accepted
    [C, steps]; -1 where a row emitted nothing or the program had ended, steps run). It ends
    early once no row is live, or once a row finished while `waiting` (requests queued).

    The loop runs on the first `window` slots of every row (copied out once per program and
    back after it): attention then reads no more than the longest live row needs. The host
    picks `window` above every live row's last write of the program; an idle row may write
    past it (clamped into its own slots, never read: its next prefill replaces the row).
    """
    step = functools.partial(_step_row, tcfg=tcfg, dcfg=dcfg, dec=dec)
    one = _vmap(lambda r: step(target_w, draft_w, vocab, r, stop_ids), data)
    c = state.n.shape[0]

    def body(i, carry):
        state, tokens, accepted = carry
        state, new, a = one(state)
        return state, tokens.at[:, i].set(new), accepted.at[:, i].set(a)

    tk, tv, dk, dv = state.tcache.k, state.tcache.v, state.dcache.k, state.dcache.v
    small = dataclasses.replace(
        state, tcache=target.KVCache(tk[:, :, :, :window], tv[:, :, :, :window]),
        dcache=draft_cache.DraftKV(dk[:, :, :window], dv[:, :, :window]))
    tokens = jnp.full((c, steps, dec.steps + 1), -1, jnp.int32)
    accepted = jnp.full((c, steps), -1, jnp.int32)
    ran, small, tokens, accepted = run_steps(body, (small, tokens, accepted), steps, waiting,
                                             state_at=0)
    state = dataclasses.replace(
        small, tcache=target.KVCache(tk.at[:, :, :, :window].set(small.tcache.k),
                                     tv.at[:, :, :, :window].set(small.tcache.v)),
        dcache=draft_cache.DraftKV(dk.at[:, :, :window].set(small.dcache.k),
                                   dv.at[:, :, :window].set(small.dcache.v)))
    return state, tokens, accepted, ran


@functools.cache
def _prefill_program(tcfg: TargetConfig, dcfg: DraftConfig, temperature: float, slots: int,
                     data: int):
    """The jitted prefill, shared by every engine of the process (eval's batch sizes and
    drafting shapes, tests) so each shape compiles once."""
    return jax.jit(functools.partial(_prefill, tcfg=tcfg, dcfg=dcfg, temperature=temperature,
                                     slots=slots, data=data), donate_argnums=(3,))


@functools.cache
def _verify_program(tcfg: TargetConfig, dcfg: DraftConfig, dec: DecodeConfig, data: int):
    return jax.jit(functools.partial(_verify, tcfg=tcfg, dcfg=dcfg, dec=dec, data=data),
                   static_argnames=("steps", "window"), donate_argnums=(3,))


def _empty(tcfg: TargetConfig, dcfg: DraftConfig, c: int, slots: int, dtype, draft_dtype,
           key_shape) -> SpecRows:
    z = jnp.zeros((c,), jnp.int32)
    tshape = (c, tcfg.num_layers, 1, slots, tcfg.num_kv_heads, tcfg.head_dim)
    dshape = (c, 1, slots, dcfg.num_kv_heads, dcfg.head_dim)
    return SpecRows(target.KVCache(jnp.zeros(tshape, dtype), jnp.zeros(tshape, dtype)),
                    draft_cache.DraftKV(jnp.zeros(dshape, draft_dtype),
                                        jnp.zeros(dshape, draft_dtype)),
                    z, z, z, z, jnp.zeros((c, 1, 1, dcfg.hidden_size), draft_dtype),
                    jnp.zeros((c, *key_shape), jnp.uint32), z, jnp.zeros((c,), bool))


# ---- host side -----------------------------------------------------------------------------


@dataclasses.dataclass
class _Row:
    request: Request
    tokens: list[int]
    accepts: list[int]


class SpecEngine:
    """Continuous batched speculative decoding of one target/draft pair (module docstring).

    `step(queue)` takes requests from the left of `queue` into free rows, runs one verify
    program (up to `sync_every` verify steps of every row) and returns the finished requests.
    """

    def __init__(self, tcfg: TargetConfig, dcfg: DraftConfig, target_w: Any, draft_w: Any,
                 vocab: VocabArrays, dec: DecodeConfig, stop_ids: Sequence[int], mesh: Mesh,
                 cfg: SpecEngineConfig):
        dec.check()
        data = batch_ways(mesh)
        if cfg.rows % data:
            raise ResourceError(f"{cfg.rows} rows cannot be split over data={data} devices; "
                                "use a multiple of the data axis")
        self.tcfg, self.dcfg, self.dec, self.mesh, self.cfg = tcfg, dcfg, dec, mesh, cfg
        self.target_w, self.draft_w, self.vocab = target_w, draft_w, vocab
        self.stop_ids = jnp.asarray(sorted(set(stop_ids)) or [-1], jnp.int32)
        self._stops = set(int(s) for s in stop_ids)
        self.rows: list[_Row | None] = [None] * cfg.rows
        self.generated_tokens = 0
        self.verify_steps = 0  # verify steps run (each advances every live row)
        self.programs: set[tuple] = set()
        key_shape = jax.random.key_data(jax.random.key(0)).shape
        shardings = jax.tree.map(
            lambda x: NamedSharding(mesh, spec_for(("batch",) + (None,) * (x.ndim - 1))),
            jax.eval_shape(lambda: _empty(tcfg, dcfg, 1, 1, jnp.float32, jnp.float32,
                                          key_shape)))
        with use_mesh(mesh):
            self.state = jax.jit(lambda: _empty(tcfg, dcfg, cfg.rows, cfg.max_context,
                                                target_w.embed.dtype, draft_w.fc.dtype,
                                                key_shape), out_shardings=shardings)()
        self._prefill = _prefill_program(tcfg, dcfg, dec.temperature, cfg.max_context, data)
        self._verify = _verify_program(tcfg, dcfg, dec, data)

    @property
    def busy(self) -> bool:
        return any(r is not None for r in self.rows)

    def check(self, r: Request) -> None:
        need = len(r.prompt) + r.max_new_tokens + max(self.dec.steps, self.dec.nodes) + 1
        if not r.prompt:
            raise ValueError(f"request {r.handle!r}: empty prompt")
        if r.max_new_tokens < 1 or need > self.cfg.max_context:
            raise ValueError(f"request {r.handle!r}: {len(r.prompt)} prompt tokens + "
                             f"{r.max_new_tokens} new + one verify's "
                             f"{max(self.dec.steps, self.dec.nodes) + 1} do not fit "
                             f"{self.cfg.max_context} slots")

    def step(self, queue: collections.deque[Request]) -> list[SpecCompletion]:
        """Admits requests into free rows, runs one verify program if any row is live;
        returns the completions, in row order."""
        done: list[SpecCompletion] = []
        admitted = []
        for i, row in enumerate(self.rows):
            if row is None and queue:
                request = queue.popleft()
                self.check(request)
                self.rows[i] = _Row(request, [], [])
                admitted.append(i)
        groups: dict[int, list[int]] = collections.defaultdict(list)
        for i in admitted:
            groups[min(bucket(len(self.rows[i].request.prompt)), self.cfg.max_context)].append(i)
        for t, members in sorted(groups.items()):
            done += self._prefill_group(members, t)
        if self.busy:
            done += self._verify_rows(waiting=bool(queue))
        return done

    def _prefill_group(self, members: list[int], t: int) -> list[SpecCompletion]:
        c = self.cfg.rows
        # few programs: up to 8 rows refill in one shape, more in P = C/16 times powers of 4
        low = c if c <= 8 else max(batch_ways(self.mesh), c // 16)
        p = min(_rows_bucket(len(members), low), c)
        prompts = np.zeros((p, t), np.int32)
        rows = np.full((p,), c, np.int32)  # padding rows write nowhere
        lengths, limits = np.ones((p,), np.int32), np.ones((p,), np.int32)
        keys = np.zeros((p, *self.state.key.shape[1:]), np.uint32)
        for j, i in enumerate(members):
            r = self.rows[i].request
            prompts[j, : len(r.prompt)] = r.prompt
            rows[j], lengths[j], limits[j] = i, len(r.prompt), r.max_new_tokens
            keys[j] = np.asarray(jax.random.key_data(jax.random.key(r.seed)))
        self.programs.add(("prefill", p, t))
        with use_mesh(self.mesh):
            self.state, first, active = self._prefill(
                self.target_w, self.draft_w, self.vocab, self.state, self.stop_ids,
                jnp.asarray(prompts), jnp.asarray(lengths), jnp.asarray(limits),
                jnp.asarray(keys), jnp.asarray(rows))
        first, active = jax.device_get((first, active))
        done = []
        for j, i in enumerate(members):
            self.rows[i].tokens.append(int(first[j]))
            self.generated_tokens += 1
            if not active[j]:
                done.append(self._retire(i))
        return done

    def _verify_rows(self, waiting: bool) -> list[SpecCompletion]:
        steps = self.cfg.sync_every
        # the furthest slot a live row can write in this program: each verify step commits
        # at most K+1 tokens and writes max(K+1, N) from its position
        longest = max(len(r.request.prompt) + len(r.tokens) for r in self.rows if r is not None)
        reach = longest + steps * (self.dec.steps + 1) + max(self.dec.steps, self.dec.nodes) + 1
        window = window_bucket(reach, self.cfg.max_context)
        self.programs.add(("verify", self.cfg.rows, steps, window))
        with use_mesh(self.mesh):
            self.state, tokens, accepted, ran = self._verify(
                self.target_w, self.draft_w, self.vocab, self.state, self.stop_ids,
                jnp.asarray(waiting), steps=steps, window=window)
        tokens, accepted, active, ran = jax.device_get((tokens, accepted, self.state.active,
                                                        ran))
        self.verify_steps += int(ran)
        done = []
        for i, row in enumerate(self.rows):
            if row is None:
                continue
            for s in range(steps):
                if accepted[i, s] >= 0:
                    row.accepts.append(int(accepted[i, s]))
                    new = [int(x) for x in tokens[i, s, : accepted[i, s] + 1]]
                    row.tokens += new
                    self.generated_tokens += len(new)
            if not active[i]:
                done.append(self._retire(i))
        return done

    def _retire(self, i: int) -> SpecCompletion:
        """The row's completion; the row is free (the device already idles it)."""
        row = self.rows[i]
        self.rows[i] = None
        r = row.request
        tokens = _truncate(row.tokens, self._stops, r.max_new_tokens)
        # a verify step may pass the limit; those tokens were never the answer's
        self.generated_tokens -= len(row.tokens) - len(tokens)
        stopped = bool(tokens) and tokens[-1] in self._stops
        return SpecCompletion(r.handle, len(r.prompt), tokens, "stop" if stopped else "length",
                              row.accepts)

    def generate(self, requests: Sequence[Request]) -> list[SpecCompletion]:
        """Every request to completion; completions in the order of `requests`."""
        return run_to_completion(self, requests)
