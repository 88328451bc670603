"""Batched generation, plain or speculative: fixed cache rows, continuous refill, one host loop.

The engine decodes up to C sequences at once. Its target KV cache holds C independent rows of
S slots (`row_cache.RowCache`, the only cache layout of the target): a row's keys sit at their
own RoPE positions, so every row has its own length, and a row that finishes takes the next
pending request at once. Programs are compiled once per shape:

    prefill   P new prompts (P fixed: C/16 rows, at least one per data-parallel device;
              padded to T tokens, a bucket of the piece's own length) start in free rows: one
              forward writes their keys and samples each one's first token (speculative:
              and captures the states the draft's step-0 entries of the prompt are made
              of). Prompts longer than `prefill_chunk` go in pieces that read the keys
              written before. A request that shares a key with rows holding a prefix of
              its prompt (`Request.share`, decode/prefixes.py: a conversation's next turn,
              a sample of the same prompt) starts after that prefix, its row kept or copied
              (`_copy_rows`) instead of prefilled again. With `mixed_budget`, prompts
              admitted while rows decode ride in the step program instead, a budget of
              their tokens per step (decode/mixed.py).
    step      up to `sync_every` device steps of all C rows in one program (a while loop):
              plain, each step feeds every row its newest token and samples the next;
              speculative (`speculation`, decode/speculative.py), each step drafts a chain
              or a tree per row and verifies every row's tokens in ONE batched target
              forward, each row accepting by its own rule. Finished and free rows idle
              (they write nothing a live query can read). The program ends early once no
              row is live, or once enough rows finished while requests wait (one in
              `refill_share` of the rows, at least one, at most as many as wait), so no
              step is run for nothing and no request waits long on idle rows (checked every
              `check_every` steps: between checks the device needs no word from the host).
              The host syncs once per program, collects the tokens, retires finished rows
              and refills them.

On the XLA path attention reads only the first `window` slots of each row, a bound over the
longest live sequence (`window_bucket`) and, speculative, over where its rows can write
during the program, so short sequences never pay for the cache's full length; the ragged
kernel reads each row to its own length, and one step program serves every length. Layers are looped over
unstacked (`target.LayerList`): scanning the stacked layers would copy each layer's weights
and cache out of the stack at every step.

Repetition (`EngineConfig.repetition`, decode/repetition.py, plain decoding): where the tokens
of a program come back to the host, an answer whose tail repeats one block is ended at the
token that completed the loop ("repetition"), as if checked after every token. The host
frees the row at once; on the device it runs on unread until a prefill takes it.

Sampling is per request, not per row (decode/sampling.py), so a request's tokens do not
depend on its row, its neighbours or the order of completion.

Shapes: C cache rows, S slots per row, P prefill rows, T prefill tokens, V target vocab,
K draft tokens per verify step, D draft hidden.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import os
import re
import types
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding

from eagle3kit.core import target
from eagle3kit.core.config import TargetConfig
from eagle3kit.core.sharding import batch_ways, spec_for, use_mesh
from eagle3kit.decode import draft_cache, parallel_draft, row_cache, speculative
from eagle3kit.decode.executables import Program
from eagle3kit.decode.kv_attention import (  # noqa: F401 (read from here too)
    KV_ATTENTION,
    KVAttention,
    auto_kv_attention,
)
from eagle3kit.decode.prefixes import Prefixes
from eagle3kit.decode.repetition import Detector, Repetition
from eagle3kit.decode.sampling import Sampling, is_stop, request_keys, sample
from eagle3kit.decode.speculative import Speculation
from eagle3kit.decode.steps import RowState, decoded, logits, run_steps
from eagle3kit.errors import ResourceError, UserError

MIN_PREFILL = 128  # shortest prefill bucket (tokens), unless prefill_chunk is shorter
MIN_WINDOW = 128  # shortest attention window (positions)


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    rows: int = 64  # C: sequences decoded at once
    max_context: int = 4096  # S: prompt + answer (+ one verify's tokens), per row
    sync_every: int = 32  # device steps per program (host syncs)
    check_every: int = 1  # device steps between a program's checks whether to end early
    # (run_steps; fewer checks, fewer of the loop's reads back to the host)
    refill_share: int = 16  # a program ends early for waiting requests once rows // this
    # (at least 1) have finished: each end costs a sync, the host's collecting and refilling,
    # and new launches while the device idles, which one end per finished row paid on
    # hundreds of rows; a finished row idles a few steps instead (its tokens are the same)
    prefill_chunk: int = 512  # longest prefill piece
    one_prefill_shape: bool = False  # every piece padded to prefill_chunk: one prefill
    # program for first pieces and one for later ones, where buckets of 128 tokens and up
    # compiled one program per size met (a few rows: a piece's padding costs little there)
    mixed_budget: int = 0  # prompt tokens a decode step carries (decode/mixed.py: mixed
    # steps, plain decoding); 0: prompts are prefilled by programs of their own
    mixed_piece: int = 64  # tokens of one prompt piece in a mixed step (divides the budget)
    sampling: Sampling = Sampling()
    seed: int = 0
    repetition: Repetition | None = None  # end answers that loop (None: never)
    attention: KVAttention = KVAttention.XLA  # how steps read the KV cache: XLA (a window
    # sliced out) or PALLAS (decode/ragged_attention: each row in place to its own length);
    # jobs resolve --kv-attention into it once (decode/kv_attention.py)

    def __post_init__(self):  # "xla" or "pallas" given as a string: the typed value
        object.__setattr__(self, "attention", KVAttention(self.attention))


@dataclasses.dataclass
class Request:
    handle: Any  # the caller's, returned with the completion
    prompt: Sequence[int]
    max_new_tokens: int
    seed: int = 0  # this request's sampling stream (decode/sampling.py)
    share: Any = None  # plain decoding: requests with the same key (not None) start from
    # the prompt prefix one of their rows holds, kept or copied, instead of prefilling it
    # again (decode/prefixes.py: a conversation's turns, the samples of one prompt)


@dataclasses.dataclass
class Completion:
    handle: Any
    prompt_len: int
    tokens: list[int]  # generated, ending with the stop token when one ended it
    finish_reason: str  # "stop" (a stop token), "length" (max_new_tokens reached) or
    # "repetition" (its last tokens repeat one block: EngineConfig.repetition)
    accept_lengths: list[int] = dataclasses.field(default_factory=list)  # speculative: the
    # draft tokens accepted at each verify step


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


def prefill_batch(c: int, ways: int = 1) -> int:
    """P, the rows of every prefill program: a sixteenth of the C cache rows, a multiple of the
    data-parallel ways (each device prefills its share), at most C."""
    return min(-(-max(c // 16, 1) // ways) * ways, c)


# ---- the device programs -------------------------------------------------------------------


def _prefill(w, draft_w, vocab, cache, dcache, state, base_key, stop_ids, tokens_PxT,
             following_PxT, rows_P, starts_P, lengths_P, limits_P, seeds_P, *,
             cfg: TargetConfig, sampling: Sampling, drafting: tuple | None, first: bool,
             window: int, data: int, rows_impl: str):
    """One prefill piece for P rows; rows whose prompt ends in it get their first token.
    `following[p, j]` is the prompt token after piece token j (the draft's step-0 entry of a
    column reads the token after it); the first generated token is put in where the prompt
    ends. Padding rows carry row index C (out of range): their writes are dropped."""
    spec = drafting and Speculation(drafting[0], draft_w, vocab, drafting[1])
    p, t = tokens_PxT.shape
    positions = starts_P[:, None] + jnp.arange(t)[None, :]
    out, cache = row_cache.forward_rows(w, cfg, tokens_PxT, positions, cache, rows_B=rows_P,
                                     window=window, prefill=first,
                                     aux_layer_ids=spec.dcfg.aux_layer_ids if spec else (),
                                     rows_impl=rows_impl)
    last = jnp.clip(lengths_P - 1 - starts_P, 0, t - 1)
    hidden = jnp.take_along_axis(out.hidden_BxTxD, last[:, None, None], axis=1)[:, 0]
    token = sample(logits(w, hidden), request_keys(base_key, seeds_P, jnp.zeros_like(seeds_P)),
                   sampling)
    ends = starts_P + t >= lengths_P
    active = ends & ~is_stop(token, stop_ids) & (limits_P > 1)

    def put(field, value):
        return field.at[rows_P].set(value.astype(field.dtype), mode="drop")

    h = state.h
    if spec is not None:
        following = jnp.where((jnp.arange(t)[None, :] == last[:, None]) & ends[:, None],
                              token[:, None], following_PxT)
        mine = draft_cache.DraftKV(dcache.k[rows_P], dcache.v[rows_P])
        h_new, mine = speculative.extend_rows(spec, w, out.aux_BxTxA, following, starts_P, last,
                                              mine, data)
        dcache = draft_cache.DraftKV(put(dcache.k, mine.k), put(dcache.v, mine.v))
        h = put(h, h_new)
    state = RowState(put(state.token, token), put(state.position, lengths_P),
                     put(state.generated, jnp.ones_like(token)), put(state.limit, limits_P),
                     put(state.seed, seeds_P), put(state.active, active), h)
    return cache, dcache, state, token


def _decode(w, draft_w, vocab, cache, dcache, state, base_key, stop_ids, waiting, *,
            cfg: TargetConfig, sampling: Sampling, steps: int, window: int, rows_impl: str,
            every: int):
    """Up to `steps` plain decoding steps of every row -> (cache, dcache, state, tokens
    [C, steps, 1] (-1 where a row emitted nothing), accepted (None), steps run)."""
    c = state.token.shape[0]

    def body(i, carry):
        cache, s, out = carry
        o, cache = row_cache.forward_rows(w, cfg, s.token[:, None], s.position[:, None], cache,
                                       window=window, rows_impl=rows_impl)
        s, out = decoded(w, o.hidden_BxTxD[:, 0], s, out, i, base_key, stop_ids, sampling)
        return cache, s, out

    out = jnp.full((c, steps, 1), -1, jnp.int32)
    ran, cache, state, out = run_steps(body, (cache, state, out), steps, waiting, state_at=1,
                                       every=every)
    return cache, dcache, state, out, None, ran


def _verify(w, draft_w, vocab, cache, dcache, state, base_key, stop_ids, waiting, *,
            cfg: TargetConfig, drafting: tuple, steps: int, window: int, data: int,
            rows_impl: str, every: int):
    """Up to `steps` speculative verify steps of every row -> (cache, dcache, state, tokens
    [C, steps, K+1], accepted [C, steps]; -1 where a row emitted nothing, steps run).

    The draft cache's first `window` slots are copied out once per program and back after
    it (the target's attention reads its own window in place); an idle row may write past
    it (clamped into its own slots, never read: its next prefill replaces the row)."""
    spec = Speculation(drafting[0], draft_w, vocab, drafting[1])
    c, k1 = state.token.shape[0], spec.dec.steps + 1

    def body(i, carry):
        cache, small, s, tokens, accepted = carry
        keys = request_keys(base_key, s.seed, s.generated)
        new, a, h, cache, small = speculative.verify_rows(
            spec, cfg, w, cache, small, s.token, s.position, s.h, keys, window=window,
            data=data, rows_impl=rows_impl)
        with jax.named_scope("bookkeeping"):
            live = s.active
            count = jnp.where(live, a + 1, 0)
            generated = s.generated + count
            shown = live[:, None] & (jnp.arange(k1)[None, :] <= a[:, None])
            stopped = (is_stop(new, stop_ids) & shown).any(-1)
            last = jnp.take_along_axis(new, a[:, None], axis=1)[:, 0]
            s = dataclasses.replace(
                s, token=jnp.where(live, last, s.token), position=s.position + count,
                generated=generated, h=jnp.where(live[:, None, None], h, s.h),
                active=live & ~stopped & (generated < s.limit))
            tokens = tokens.at[:, i].set(jnp.where(shown, new, -1))
            accepted = accepted.at[:, i].set(jnp.where(live, a, -1))
        return cache, small, s, tokens, accepted

    dk, dv = dcache.k, dcache.v
    whole = window >= dk.shape[1]  # the kernel's one program: no window copied out and back
    small = dcache if whole else draft_cache.DraftKV(dk[:, :window], dv[:, :window])
    tokens = jnp.full((c, steps, k1), -1, jnp.int32)
    accepted = jnp.full((c, steps), -1, jnp.int32)
    ran, cache, small, state, tokens, accepted = run_steps(
        body, (cache, small, state, tokens, accepted), steps, waiting, state_at=2, every=every)
    dcache = small if whole else draft_cache.DraftKV(dk.at[:, :window].set(small.k),
                                                     dv.at[:, :window].set(small.v))
    return cache, dcache, state, tokens, accepted, ran


@functools.cache
def _allocators(mesh: Mesh) -> Any:
    """Jitted zeros of the target cache, the row state and the draft cache on `mesh`, shared
    by every engine of the process (one made per engine compiled its zeros once per engine:
    an eval builds one per batch size and drafting shape)."""
    rows = NamedSharding(mesh, spec_for(("batch",)))  # rows split, the rest whole
    heads = NamedSharding(mesh, spec_for(("batch", None, "act_heads", None)))
    return types.SimpleNamespace(
        cache=Program(row_cache.RowCache.zeros, "engine.cache_zeros",
                      static_argnums=(0, 1, 2, 3), out_shardings=heads),
        state=Program(RowState.empty, "engine.state_empty", static_argnums=(0, 1, 2),
                      out_shardings=rows),
        draft=Program(draft_cache.DraftKV.zeros, "engine.draft_zeros",
                      static_argnums=(0, 1, 2, 3), out_shardings=rows))


def _copy_rows_of(cache: row_cache.RowCache, src_P, dst_P) -> row_cache.RowCache:
    """Cache row src_P[p] copied whole into row dst_P[p] (C: padding, dropped)."""
    def move(x):
        return x.at[dst_P].set(x[src_P], mode="drop")

    return row_cache.RowCache([move(k) for k in cache.k], [move(v) for v in cache.v])


_copy_rows = Program(_copy_rows_of, "engine.copy_rows", donate_argnums=0)


@functools.cache
def _programs(tcfg: TargetConfig, sampling: Sampling, drafting: tuple | None, data: int,
              rows_impl: str, every: int = 1):
    """The jitted prefill and step of one target, sampling rule, drafting shape ((draft
    config, DecodeConfig) or None: plain), cache attention and steps between the step
    program's checks (`run_steps`), shared by every engine of the process (an eval's batch
    sizes, tests) so each shape compiles once."""
    prefill = Program(functools.partial(_prefill, cfg=tcfg, sampling=sampling,
                                        drafting=drafting, data=data, rows_impl=rows_impl),
                      "engine.prefill", static_argnames=("first", "window"),
                      donate_argnums=(3, 4, 5))
    if drafting is None:
        step = functools.partial(_decode, cfg=tcfg, sampling=sampling, rows_impl=rows_impl,
                                 every=every)
    else:
        step = functools.partial(_verify, cfg=tcfg, drafting=drafting, data=data,
                                 rows_impl=rows_impl, every=every)
    return prefill, Program(step, "engine.verify" if drafting else "engine.decode",
                            static_argnames=("steps", "window"), donate_argnums=(3, 4, 5))


# ---- host side -----------------------------------------------------------------------------


@dataclasses.dataclass
class _Row:
    request: Request
    tokens: list[int]
    remaining_prompt: int  # prompt tokens not yet prefilled (long prompts go in pieces)
    accepts: list[int] = dataclasses.field(default_factory=list)


class Engine:
    """Continuous batched generation of one target, plain or speculative with `speculation`
    (see the module docstring).

    `step(queue)` takes requests from the left of `queue` into free rows, advances every live
    row by up to `sync_every` device steps and returns the requests that finished.
    """

    def __init__(self, tcfg: TargetConfig, weights: target.TargetWeights | target.LayerList,
                 mesh: Mesh, stop_ids: Sequence[int], cfg: EngineConfig,
                 speculation: Speculation | None = None):
        data = batch_ways(mesh)
        if cfg.rows % data:
            raise ResourceError(f"{cfg.rows} rows cannot be split over data={data} devices; "
                                "use a multiple of the data axis")
        if cfg.check_every < 1 or cfg.sync_every % cfg.check_every:
            raise ValueError(f"check_every {cfg.check_every}: a divisor of sync_every "
                             f"({cfg.sync_every})")
        if cfg.prefill_chunk & (cfg.prefill_chunk - 1) or cfg.prefill_chunk < 16:
            raise ValueError(f"prefill_chunk {cfg.prefill_chunk}: a power of two >= 16")
        spec = speculation
        if spec is not None:
            spec.dec.check()
            if parallel_draft.is_parallel(spec.dcfg):
                parallel_draft.check(spec.dcfg, spec.dec.steps, spec.dec.topk)
            if cfg.sampling != Sampling(spec.dec.temperature):
                raise ValueError("speculative decoding samples at the drafting temperature "
                                 "alone (no top-p, top-k): pass Sampling(dec.temperature)")
            if cfg.repetition is not None:
                raise ValueError("the repetition rule ends plain generation only")
            if cfg.mixed_budget:
                raise ValueError("mixed steps are for plain decoding (a verify step does "
                                 "not carry prompt pieces yet)")
        if cfg.mixed_budget and (cfg.mixed_piece < 1 or cfg.mixed_budget % cfg.mixed_piece
                                 or data > 1):
            raise ValueError(f"mixed_budget {cfg.mixed_budget}: a multiple of mixed_piece "
                             f"({cfg.mixed_piece}), on one data-parallel way (not {data})")
        self.tcfg, self.mesh, self.cfg, self.spec = tcfg, mesh, cfg, spec
        # per-layer weights: see target.LayerList. A stacked target is copied unstacked (the
        # caller keeps its own); jobs pass target.unstack_in_place's, the target held once
        self.w = weights if isinstance(weights, target.LayerList) else \
            jax.jit(target.unstack, static_argnums=1)(weights, tcfg)
        # host arrays go to the device by device_put: jnp.asarray compiles a program per
        # shape and dtype ("stage"), which a new process pays again where the engine's own
        # programs come whole from the compile cache (decode/executables.py)
        self.stop_ids = jax.device_put(np.asarray(sorted(set(stop_ids)) or [-1], np.int32))
        self._stops = set(int(s) for s in stop_ids)  # the host's copy, for _emit
        self.base_key = jax.random.key(cfg.seed)
        self.rows: list[_Row | None] = [None] * cfg.rows
        self.generated_tokens = 0
        self.device_steps = 0  # decode or verify steps run (each advances every live row)
        self.step_programs = 0  # decode, verify or mixed programs run (one host sync each)
        self.programs: set[tuple] = set()  # compiled shapes, for reporting
        self.prefilled_tokens = 0  # prompt tokens prefilled (pieces' padding not counted)
        self.reused_tokens = 0  # prompt tokens a row held already (Request.share)
        self.prefill_batch = prefill_batch(cfg.rows, batch_ways(mesh))
        dtype = self.w.embed.dtype
        self.memory = memory_estimate(tcfg, cfg, dtype, spec)
        self.cache_bytes = self.memory["cache"]
        check_memory(self.memory, mesh)
        draft_dtype = spec and spec.draft_w.fc.dtype
        zeros = _allocators(mesh)
        with use_mesh(mesh):
            self.cache = zeros.cache(tcfg, cfg.rows, cfg.max_context, dtype)
            self.state = zeros.state(cfg.rows, spec.dcfg.hidden_size if spec else 0,
                                     draft_dtype or jnp.float32)
            self.dcache = None if spec is None else zeros.draft(
                spec.dcfg, cfg.rows, cfg.max_context, draft_dtype)
        if cfg.attention == KVAttention.PALLAS and mesh.devices.size > 1:
            raise ValueError(f"the ragged kernel (attention 'pallas') runs on one device, not "
                             f"a mesh of {mesh.devices.size}: run one process per GPU")
        self._prefill, self._step = _programs(
            tcfg, cfg.sampling, spec and (spec.dcfg, spec.dec), data, cfg.attention.value,
            cfg.check_every)
        from eagle3kit.decode import mixed  # (which builds on this module)

        self._mixed = cfg.mixed_budget and mixed.program(tcfg, cfg.sampling,
                                                         cfg.attention.value, cfg.check_every)
        self._repeats = cfg.repetition and Detector(cfg.repetition, cfg.rows)
        self._prefixes = Prefixes(cfg.rows)
        # prefill programs' first tokens not yet read: (device array [P], [(index in it,
        # row)]), read with the next step program's tokens (`_started`)
        self._firsts: list[tuple[Any, list[tuple[int, int]]]] = []

    @property
    def busy(self) -> bool:
        return any(r is not None for r in self.rows)

    @property
    def free_rows(self) -> int:
        return sum(r is None for r in self.rows)

    @property
    def verified(self) -> int:
        """Slots one device step writes per row past its newest token."""
        return self.spec.dec.verified if self.spec else 1

    def step(self, queue: collections.deque[Request]) -> list[Completion]:
        """Admits requests from the left of `queue` into free rows, prefills them, runs one
        device program if any row is live; returns the completions, in row order."""
        done: list[Completion] = []
        free = [i for i, row in enumerate(self.rows) if row is None]
        # prompts ride in the decode steps of rows that decode (decode/mixed.py); a request
        # whose key has a row still being prefilled waits to copy it
        ride = bool(self._mixed) and any(r is not None and r.remaining_prompt == 0
                                         for r in self.rows)
        filling = {i for i, r in enumerate(self.rows) if r is not None and r.remaining_prompt}
        deferred = []
        admitted: list[int] = []  # prefilled first (some after copying a held prefix)
        copies: list[tuple[int, int]] = []  # (row, row it copies from) before the prefill
        later: list[tuple[int, int]] = []  # copy from a row this step prefills, then prefill
        while free and queue:
            request = queue.popleft()
            self.check(request)
            if ride and filling & self._prefixes.by_key.get(request.share, set()):
                deferred.append(request)
                continue
            i, source, held = self._prefixes.place(request.share, request.prompt, free,
                                                   {j for j, _ in later} | filling)
            free.remove(i)
            if ride:
                filling.add(i)
            self.rows[i] = _Row(request, [], len(request.prompt) - held)
            self._prefixes.own(i, request.share, request.prompt, self.rows[i].tokens)
            self.reused_tokens += held
            if self._repeats:
                self._repeats.reset(i)
            if source is not None and source in admitted:
                later.append((i, source))
                continue
            if source is not None:
                copies.append((i, source))
            admitted.append(i)
        queue.extendleft(reversed(deferred))
        if copies:
            self._copy(copies)
        if ride and filling:
            return done + self._run_mixed(waiting=self._refill_at(len(queue)))
        admitted += [i for i in sorted(filling) if i not in admitted]  # pieces left over
        if admitted:
            self._prefill_rows(admitted)
        if later:
            self._copy(later)
            self._prefill_rows([i for i, _ in later])
        if any(r is not None and r.remaining_prompt == 0 for r in self.rows):
            done += self._run_rows(waiting=self._refill_at(len(queue)))
        if self._firsts:  # no step program ran to read them with
            done += self._started(jax.device_get([f for f, _ in self._firsts]))
        return done

    def check(self, r: Request) -> None:
        """Refuses a request that cannot fit a row: its prompt, its answer and one device
        step's writes past the answer's last committed token."""
        extra = self.verified if self.spec else 0
        if not r.prompt:
            raise ValueError(f"request {r.handle!r}: empty prompt")
        if r.share is not None and self.spec is not None:
            raise ValueError(f"request {r.handle!r}: shared prefixes are for plain decoding "
                             "(a speculative row's draft cache is not kept)")
        if not 1 <= r.max_new_tokens <= self.cfg.max_context - len(r.prompt) - extra:
            more = f" + one verify's {extra}" if extra else ""
            raise ValueError(f"request {r.handle!r}: {len(r.prompt)} prompt tokens + "
                             f"{r.max_new_tokens} new{more} do not fit {self.cfg.max_context}")

    def _prefill_rows(self, rows: list[int]) -> None:
        """Prefills the rows' prompts, piece by piece; the first tokens of the rows whose
        prompt is in are read later, with the step program's tokens (`_started`)."""
        while rows:
            # every admitted row's next piece; rows with a longer prompt come back for more
            start = {i: len(self.rows[i].request.prompt) - self.rows[i].remaining_prompt
                     for i in rows}
            groups: dict[tuple[bool, int, int], list[int]] = collections.defaultdict(list)
            for i in rows:
                piece = min(self.rows[i].remaining_prompt, self.cfg.prefill_chunk)
                groups[self._piece_shape(start[i], piece)].append(i)
            # P rows per prefill program, always the same P: a prompt's sums must not depend
            # on how many others were admitted with it (a matmul's rounding depends on its
            # shape, and a near-tie would turn the answer), and a refill of one row pays for
            # P rows, a sixteenth of the cache's
            p = self.prefill_batch
            for (first, t, window), members in sorted(groups.items()):
                for k in range(0, len(members), p):
                    self._prefill_group(members[k: k + p], start, first, t, window)
            rows = [i for i in rows if self.rows[i].remaining_prompt > 0]

    def _piece_shape(self, start: int, piece: int) -> tuple[bool, int, int]:
        """(first, tokens T, window) of the prefill program of a `piece`-token prompt piece
        from prompt token `start`."""
        # few shapes (each is a compiled program): 128-token pieces and up, and later
        # pieces of long prompts read the whole row
        chunk = self.cfg.prefill_chunk
        t = chunk if self.cfg.one_prefill_shape else bucket(piece, min(MIN_PREFILL, chunk))
        return start == 0, t, 0 if start == 0 else self.cfg.max_context

    def _copy(self, pairs: list[tuple[int, int]]) -> None:
        """Copies whole cache rows (row, from), P at a time: one program for every count."""
        c, p = self.cfg.rows, self.prefill_batch
        self.programs.add(("copy", p))
        for k in range(0, len(pairs), p):
            src, dst = np.zeros((p,), np.int32), np.full((p,), c, np.int32)
            for j, (i, source) in enumerate(pairs[k: k + p]):
                dst[j], src[j] = i, source
            with use_mesh(self.mesh):
                self.cache = _copy_rows(self.cache, jax.device_put(src), jax.device_put(dst))

    def _prefill_group(self, members, start, first, t, window) -> None:
        c, p = self.cfg.rows, self.prefill_batch
        tokens, following = np.zeros((p, t), np.int32), np.zeros((p, t), np.int32)
        rows = np.full((p,), c, np.int32)  # padding rows write nowhere
        starts, lengths = np.zeros((p,), np.int32), np.ones((p,), np.int32)
        limits, seeds = np.ones((p,), np.int32), np.zeros((p,), np.uint32)
        for j, i in enumerate(members):
            r = self.rows[i].request
            piece = list(r.prompt[start[i]: start[i] + t])
            after = list(r.prompt[start[i] + 1: start[i] + t + 1])
            tokens[j, : len(piece)], following[j, : len(after)] = piece, after
            rows[j], starts[j], lengths[j] = i, start[i], len(r.prompt)
            limits[j], seeds[j] = r.max_new_tokens, np.uint32(r.seed & 0xFFFFFFFF)
        self.programs.add(("prefill", p, t, window))
        with use_mesh(self.mesh):
            self.cache, self.dcache, self.state, first_tokens = self._prefill(
                *self._prefill_args(tokens, following, rows, starts, lengths, limits, seeds),
                first=first, window=window or t)
        started = []
        for j, i in enumerate(members):
            row = self.rows[i]
            row.remaining_prompt = max(0, len(row.request.prompt) - start[i] - t)
            self.prefilled_tokens += min(t, len(row.request.prompt) - start[i])
            if row.remaining_prompt == 0:
                started.append((j, i))
        if started:
            # read with the step program's tokens, in one transfer: a read here would make
            # the host wait for this program before it dispatches the next one
            self._firsts.append((first_tokens, started))

    def _started(self, firsts: list) -> list[Completion]:
        """The first tokens of the rows whose prompt a prefill program took in
        (`self._firsts`, read to the host as `firsts`), appended as their rows' first
        tokens; a row they end (a stop token, a limit of one) is retired."""
        started = {i: [int(tokens[j])] for tokens, (_, rows) in zip(firsts, self._firsts,
                                                                   strict=True)
                   for j, i in rows}
        self._firsts = []
        return self._emit_rows(started, {}) if started else []

    def _prefill_args(self, *host: np.ndarray) -> tuple:
        """A prefill program's arguments before its static ones: the engine's arrays, then
        the pieces' (tokens, following, rows, starts, lengths, limits, seeds)."""
        spec = self.spec
        return (self.w, spec and spec.draft_w, spec and spec.vocab, self.cache, self.dcache,
                self.state, self.base_key, self.stop_ids, *jax.device_put(host))

    def _refill_at(self, queued: int) -> int:
        """How many rows must finish for a program to end early: none while no request
        waits (0), else one in `refill_share` of the rows, no more than wait."""
        return min(queued, max(1, self.cfg.rows // self.cfg.refill_share))

    def _step_args(self, waiting: int) -> tuple:
        spec = self.spec
        return (self.w, spec and spec.draft_w, spec and spec.vocab, self.cache, self.dcache,
                self.state, self.base_key, self.stop_ids, jax.device_put(np.int32(waiting)))

    def _run_rows(self, waiting: int) -> list[Completion]:
        steps = self.cfg.sync_every
        window = self._window(steps)
        self.programs.add(("verify" if self.spec else "decode", self.cfg.rows, steps, window))
        with use_mesh(self.mesh):
            self.cache, self.dcache, self.state, out, accepted, ran = self._step(
                *self._step_args(waiting), steps=steps, window=window)
        firsts, (out, accepted, ran) = jax.device_get(([f for f, _ in self._firsts],
                                                       (out, accepted, ran)))
        # the prefilled rows' first tokens come before the program's: a row one of them
        # ended is not live in it (the device idled it too)
        return self._started(firsts) + self._collect(out, accepted, ran)

    def compilers(self, prompt_lengths: Sequence[int], later_pieces: Sequence[int] = ()
                  ) -> list[Callable[[], Any]]:
        """Thunks that compile ahead the programs requests with prompts of these lengths will
        run (every piece's prefill shape; the step where one program serves every length:
        the kernel's), to be run several at once (XLA compiles without Python's lock):
        the requests then compile nothing of these. `later_pieces`: lengths of pieces that
        start after a prefix a row holds (`Request.share`: a conversation's next turn, a
        sample's last prompt token), whose rows may be copied first (the copy program).
        Each is compiled as the engine will call it (same arguments, same mesh), so a call
        finds it in JAX's caches."""
        chunk, p, c = self.cfg.prefill_chunk, self.prefill_batch, self.cfg.rows
        shapes = {self._piece_shape(start, min(n - start, chunk))
                  for n in prompt_lengths for start in range(0, n, chunk)}
        shapes |= {self._piece_shape(1, min(n, chunk)) for n in later_pieces}
        todo = []
        if later_pieces:
            self.programs.add(("copy", p))
            rows = [jax.device_put(np.zeros((p,), np.int32)) for _ in range(2)]
            todo.append(functools.partial(self._compile, _copy_rows, (self.cache, *rows)))
        for first, t, window in sorted(shapes):
            self.programs.add(("prefill", p, t, window))
            pieces = [np.zeros((p, t), np.int32)] * 2  # _prefill_group's dtypes and shapes
            rows = [np.full((p,), c, np.int32)] + [np.ones((p,), np.int32)] * 3
            args = self._prefill_args(*pieces, *rows, np.zeros((p,), np.uint32))
            todo.append(functools.partial(self._compile, self._prefill, args,
                                          first=first, window=window or t))
        steps = self.cfg.sync_every
        if self.cfg.attention != KVAttention.XLA:
            window = self._window(steps)
            self.programs.add(("verify" if self.spec else "decode", c, steps, window))
            todo.append(functools.partial(self._compile, self._step, self._step_args(0),
                                          steps=steps, window=window))
        return todo

    def _compile(self, program: Program, args: tuple, **static) -> None:
        with use_mesh(self.mesh):
            program.compile(*args, **static)

    def _window(self, steps: int, prompts: Sequence[int] = ()) -> int:
        """The cache slots a program of `steps` steps reads (the XLA path): past every live
        row's furthest write, and every prompt (`prompts`: lengths) being prefilled in it."""
        if self.cfg.attention != "xla":
            # the kernel reads each row to its own length and no window: one program serves
            # every length, where a window bucket each recompiled the same step (8B: ~10;
            # a verify step too: its draft's one layer then attends over the whole draft
            # cache, small next to the target's reads, and an eval compiled the step once
            # per bucket, for each drafting shape)
            return self.cfg.max_context
        # (a row whose first token is not read yet holds it: one token)
        longest = max([len(r.request.prompt) + max(len(r.tokens), 1) for r in self.rows
                       if r is not None and r.remaining_prompt == 0] + list(prompts))
        # the furthest slot a live row can write in this program: each step commits at
        # most K+1 tokens (plain: 1) and writes `verified` from its newest token's slot
        per_step = self.spec.dec.steps + 1 if self.spec else 1
        return window_bucket(longest + steps * per_step + self.verified - per_step,
                             self.cfg.max_context)

    def _run_mixed(self, waiting: int) -> list[Completion]:
        """One program whose first steps carry the pieces of the prompts being prefilled
        (decode/mixed.py), then plain steps; rows whose prompt is in go live in it."""
        from eagle3kit.decode import mixed

        c, t, steps = self.cfg.rows, self.cfg.mixed_piece, self.cfg.sync_every
        g = self.cfg.mixed_budget // t
        prompts = {i: (r.request, len(r.request.prompt) - r.remaining_prompt)
                   for i, r in enumerate(self.rows) if r is not None and r.remaining_prompt}
        p = mixed.plan(prompts, c, g, t, steps)
        window = self._window(steps, [len(r.prompt) for r, _ in prompts.values()])
        self.programs.add(("mixed", c, steps, window, g, t))
        with use_mesh(self.mesh):
            self.cache, _, self.state, out, _, ran = self._mixed(
                self.w, None, None, self.cache, None, self.state, self.base_key,
                self.stop_ids, jax.device_put(np.int32(waiting)), jax.device_put(p.waves),
                jax.device_put(p.prefilling), steps=steps, window=window)
        out, ran = jax.device_get((out, ran))
        for wave in p.pieces[: int(ran)]:  # a program that ended early ran fewer waves
            for i, start in wave:
                row = self.rows[i]
                self.prefilled_tokens += min(t, len(row.request.prompt) - start)
                row.remaining_prompt = max(0, len(row.request.prompt) - start - t)
        return self._collect(out, None, ran)

    def _collect(self, out, accepted, ran) -> list[Completion]:
        """A step program's tokens [C, steps, K+1] (and accepted counts) to the live rows."""
        self.device_steps += int(ran)
        self.step_programs += 1
        out = np.asarray(out)
        live = [i for i, row in enumerate(self.rows) if row is not None
                and row.remaining_prompt == 0]
        new = {i: [int(x) for x in out[i].reshape(-1) if x >= 0] for i in live}
        # every row the host holds live is live on the device, so its first step emits a
        # token; a row without one means the two disagree, and waiting on it would loop forever
        idle = [i for i in live if not new[i]]
        if idle:
            raise RuntimeError(f"engine: rows {idle} emitted no token in a program of {int(ran)} "
                               "steps though the host holds them live (the device's row "
                               "state and the host's disagree)")
        return self._emit_rows(new,
                               {} if accepted is None else
                               {i: [int(a) for a in accepted[i] if a >= 0] for i in live})

    def _emit_rows(self, new: dict[int, list[int]], accepts: dict[int, list[int]]
                   ) -> list[Completion]:
        """Each row's new tokens, cut after a repetition when one completed among them."""
        loops = [None] * len(new)
        k = max(map(len, new.values()), default=0)  # a row with fewer tokens has finished
        if self._repeats and k:
            loops = self._repeats.feed(list(new), [t + [-1] * (k - len(t))
                                                   for t in new.values()])
        done = []
        for (i, tokens), loop in zip(new.items(), loops, strict=True):
            self.rows[i].accepts += accepts.get(i, [])
            done += self._emit(i, tokens, loop)
        return done

    def _emit(self, i: int, tokens: list[int], loop: int | None = None) -> list[Completion]:
        """Appends a row's new tokens; retires it when a stop token or its limit ends it (the
        device applied the same rule, so the row is already idle there; a verify step may
        pass the limit: those tokens were never the answer's), or at the `loop`-th token,
        which completed a repetition."""
        row = self.rows[i]
        for n, tok in enumerate(tokens, start=1):
            row.tokens.append(tok)
            self.generated_tokens += 1
            stopped = tok in self._stops
            if stopped or len(row.tokens) >= row.request.max_new_tokens or n == loop:
                self.rows[i] = None
                self._prefixes.freed(i)
                reason = "stop" if stopped else "repetition" if n == loop else "length"
                return [Completion(row.request.handle, len(row.request.prompt), row.tokens,
                                   reason, row.accepts)]
        return []

    def generate(self, requests: Sequence[Request]) -> list[Completion]:
        """Every request to completion; completions in the order of `requests`."""
        queue = collections.deque(requests)
        by_handle: dict[Any, Completion] = {}
        while queue or self.busy:
            for c in self.step(queue):
                by_handle[c.handle] = c
        return [by_handle[r.handle] for r in requests]


class OutOfMemory(ResourceError):
    """The engine's caches and a device step's temporaries do not fit the free memory (the
    pre-flight estimate): the job says which of its options to lower (jobs/common)."""


def memory_estimate(tcfg: TargetConfig, cfg: EngineConfig, dtype: Any,
                    spec: Speculation | None = None) -> dict[str, int]:
    """Bytes over all devices: the target and draft caches, and the largest temporaries of a
    device step at the full window (measured on XLA's programs: every layer's window of keys
    and values copied out of the cache is live at once, plus one layer's scores and the fp32
    logits with their softmax and top-p's copies, measured when top-p sorted them: an upper
    bound since) and of a prefill piece (its scores and activations).
    Cheap: arithmetic only, no compilation."""
    c, s, item = cfg.rows, cfg.max_context, jnp.dtype(dtype).itemsize
    t = spec.dec.verified if spec else 1
    kv = 2 * tcfg.num_kv_heads * tcfg.head_dim * item  # one slot's keys and values, one layer
    cache = tcfg.num_layers * c * s * kv
    if spec is not None:
        d = spec.dcfg  # a cache layer per draft layer (decode/parallel_draft.py)
        cache += c * s * 2 * d.num_layers * d.num_kv_heads * d.head_dim * \
            jnp.dtype(spec.draft_w.fc.dtype).itemsize
    step = (tcfg.num_layers * c * s * kv + c * t * tcfg.num_heads * s * 4
            + 3 * c * t * tcfg.vocab_size * 4)
    if cfg.mixed_budget:  # a mixed step's pieces: their rows' windows, scores, activations
        pieces = cfg.mixed_budget // cfg.mixed_piece
        step += (tcfg.num_layers * pieces * s * kv + cfg.mixed_budget * tcfg.num_heads * s * 4
                 + 4 * cfg.mixed_budget * tcfg.intermediate_size * item)
    p, piece = prefill_batch(c), min(cfg.prefill_chunk, s)
    prefill = (p * piece * tcfg.num_heads * s * 4 + 4 * p * piece * tcfg.intermediate_size
               * item + p * tcfg.vocab_size * 4)
    return {"cache": cache, "temporaries": max(step, prefill)}


def free_bytes(mesh: Mesh) -> int | None:
    """Free memory of one device: what it reports, capped by EAGLE3KIT_DEVICE_MEMORY (bytes,
    or with a K/M/G/T suffix: plan as if each device had that much, e.g. to leave room for
    another process). A CPU device reports none: its memory is the host's, what the kernel
    says is available, shared by the mesh's devices."""
    stats = mesh.devices.flat[0].memory_stats() or {}
    free = stats["bytes_limit"] - stats.get("bytes_in_use", 0) if "bytes_limit" in stats \
        else None
    if free is None and mesh.devices.flat[0].platform == "cpu":
        free = host_available_bytes() // mesh.devices.size
    given = os.environ.get("EAGLE3KIT_DEVICE_MEMORY", "").strip()
    if given:
        m = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([KMGT]?)(?:I?B)?", given.upper())
        if not m:
            raise UserError(f"EAGLE3KIT_DEVICE_MEMORY={given!r}: expected bytes, e.g. 24G "
                                "or 24GiB")
        cap = int(float(m[1]) * 1024 ** " KMGT".index(m[2] or " "))
        free = cap if free is None else min(free, cap)
    return free


def host_available_bytes() -> int:
    """The host memory a new allocation can take (MemAvailable: free memory and page cache
    the kernel can drop), else all of it where /proc/meminfo is not there."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def check_memory(need: dict[str, int], mesh: Mesh) -> None:
    """Refuses caches and step temporaries that cannot fit, before allocating anything."""
    free = free_bytes(mesh)
    per_device = sum(need.values()) / mesh.devices.size
    if free is not None and per_device > 0.9 * free:
        gib = {k: v / mesh.devices.size / 2**30 for k, v in need.items()}
        raise OutOfMemory(f"the KV cache ({gib['cache']:.2f} GiB) and a step's temporaries "
                          f"({gib['temporaries']:.2f} GiB) need {per_device / 2**30:.2f} GiB "
                          f"per device, more than the {free / 2**30:.2f} GiB free")
