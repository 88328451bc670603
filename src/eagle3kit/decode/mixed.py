"""Mixed steps: prompt pieces ride inside the decode steps of the rows already decoding, as a
second token group of the same forward (`EngineConfig.mixed_budget` > 0, plain decoding).

Why in the step. Without it (decode/engine.py) a refilled row's prompt is prefilled by a
program of its own before the next decode program: every decoding row waits while it runs,
and a long prompt (a conversation's later turn) stalls them all; the prefill's P rows are
padded to a bucket of the longest piece, and each refill costs one more program and one more
sync with the host. A decode step of C rows reads every weight of the target for C tokens
each; a few hundred prompt tokens more in the same matmuls cost little beside that read (as
vLLM's and SGLang's chunked prefill schedule it), and the decoding rows never stop.

The step's two token groups. Group A is the C rows' newest tokens, as a plain step feeds them.
Group B is G pieces of T prompt tokens (T = `mixed_piece`, G = `mixed_budget` / T), each a
(row, first slot) of a prompt, padding pieces aimed at row C (their writes are dropped). Both
groups are one flat run of C + G*T tokens through the layers' matmuls; only attention tells
them apart (`TwoGroups`): group A reads each row's cache to its newest token, group B writes
its pieces' keys first, then each piece reads its row's slots before it and itself causally
(`ragged_attention.attend_rows`'s contract, the block mask of a chain). Because every piece's
keys are written before any piece reads, two pieces of one prompt may share a step: the
second reads the first's keys. The shapes are fixed (C, G, T), so one mixed program serves
every step (one per window bucket on the XLA path, one in all with the ragged kernel), and a
row's sums never take their shape from how many prompts arrived with it.

The budget. Every step carries all C decoding rows (the cache's rows, fixed); the budget is
what prompts add on top: G*T tokens per step, filled first come first served, each prompt's
pieces in order, as many pieces of one prompt in a step as fit. The host plans up to
`sync_every` steps of pieces per program (`plan`): the pieces ride in the program's first
steps ("waves"), plain decoding steps follow in the same program. Pieces that did not fit
ride in the next program.

From prefill to decode. A row being prefilled is idle in group A (its decode-group writes go
to the slot its first decode step writes: its prompt's end, never a prompt key). In the wave
that holds a prompt's last piece, the row samples its first token from that piece's hidden
state at the prompt's last token (the stream's first draw, as a prefill program draws it),
becomes live, and decodes in the very next step of the same program; its first token is
among the program's tokens. A program that ends early (a row finished while requests wait)
after fewer waves than planned leaves the rest of the pieces to the next program: the host
counts what ran.

When. The engine mixes only while some row is decoding (otherwise nothing would ride along,
and the prefill program's P x T shape is the better one) and on one data-parallel way (the
flat group is one batch row). A request whose share key has a row still being prefilled
waits for it (decode/prefixes.py: it copies that row once the prompt is in).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from eagle3kit.core import target
from eagle3kit.core.config import TargetConfig
from eagle3kit.decode import row_cache
from eagle3kit.decode.executables import Program
from eagle3kit.decode.sampling import Sampling, is_stop, request_keys, sample
from eagle3kit.decode.steps import RowState, decoded, logits, refill_due, run_steps


@dataclasses.dataclass(frozen=True)
class TwoGroups(row_cache.RowAttention):
    """The attention of a mixed step: this RowAttention is group A (the C rows' newest
    tokens, rows_B None), `pieces` group B; q, k, v arrive as one flat run [1, C + G*T]."""

    pieces: row_cache.RowAttention | None = None

    def __call__(self, q, k, v, layer: int, sinks):
        c = self.prefix_B.shape[0]
        g, t = self.pieces.q_positions_BxT.shape

        def split(x):
            return x[0, :c, None], x[0, c:].reshape(g, t, *x.shape[2:])

        (qa, qb), (ka, kb), (va, vb) = split(q), split(k), split(v)
        a = super().__call__(qa, ka, va, layer, sinks)  # [C,1,N,H]
        b = self.pieces(qb, kb, vb, layer, sinks)  # [G,T,N,H]
        return jnp.concatenate([a[:, 0], b.reshape(g * t, *b.shape[2:])])[None]


def forward(w: target.LayerList, cfg: TargetConfig, state: RowState, tokens_GxT, rows_G,
            starts_G, cache: row_cache.RowCache, *, window: int, rows_impl: str
            ) -> tuple[jax.Array, jax.Array, row_cache.RowCache]:
    """One mixed step's forward -> (hidden [C,D] of the rows' newest tokens, hidden [G,T,D]
    of the pieces, cache). Piece g is tokens_GxT[g] at slots starts_G[g].. of row rows_G[g]
    (C: padding, nothing written)."""
    c = state.token.shape[0]
    g, t = tokens_GxT.shape
    positions_GxT = starts_G[:, None] + jnp.arange(t)[None, :]
    tokens = jnp.concatenate([state.token, tokens_GxT.reshape(-1)])[None]
    positions = jnp.concatenate([state.position, positions_GxT.reshape(-1)])[None]
    ks, vs = list(cache.k), list(cache.v)
    matmul = "pallas" if rows_impl == "pallas" and jax.default_backend() == "gpu" else "xla"
    pieces = row_cache.RowAttention(cfg, ks, vs, rows_G, starts_G, positions_GxT, None, window,
                                 rows_impl=rows_impl, matmul_impl=matmul)
    attention = TwoGroups(cfg, ks, vs, None, state.position, state.position[:, None], None,
                          window, rows_impl=rows_impl, matmul_impl=matmul, pieces=pieces)
    out = target.loop_layers(w, cfg, tokens, positions, attention)
    hidden = out.hidden_BxTxD[0]
    return hidden[:c], hidden[c:].reshape(g, t, -1), row_cache.RowCache(ks, vs)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Waves:
    """The prompt pieces of one program: wave i rides in its step i. [W,G] per piece (W =
    the program's steps), tokens [W,G,T]; `count` waves hold pieces."""

    tokens: Any
    rows: Any  # C: an empty slot
    starts: Any
    lengths: Any  # the piece's prompt's length
    limits: Any  # its request's max new tokens
    seeds: Any  # its request's sampling stream (uint32)
    count: Any


def started(w, hidden_GxTxD, s: RowState, out, i, waves: Waves, base_key, stop_ids,
            sampling: Sampling) -> tuple[RowState, jax.Array]:
    """Rows whose prompt ends in wave i sample their first token (out[row, i]) and go live."""
    c = s.token.shape[0]
    t = hidden_GxTxD.shape[1]
    rows, starts, lengths = waves.rows[i], waves.starts[i], waves.lengths[i]
    limits, seeds = waves.limits[i], waves.seeds[i]
    last = jnp.clip(lengths - 1 - starts, 0, t - 1)
    hidden = jnp.take_along_axis(hidden_GxTxD, last[:, None, None], axis=1)[:, 0]
    token = sample(logits(w, hidden), request_keys(base_key, seeds, jnp.zeros_like(seeds)),
                   sampling)
    at = jnp.where(starts + t >= lengths, rows, c)  # rows whose prompt ends here

    def put(field, value):
        return field.at[at].set(value.astype(field.dtype), mode="drop")

    s = dataclasses.replace(
        s, token=put(s.token, token), position=put(s.position, lengths),
        generated=put(s.generated, jnp.ones_like(token)), limit=put(s.limit, limits),
        seed=put(s.seed, seeds),
        active=put(s.active, ~is_stop(token, stop_ids) & (limits > 1)))
    return s, out.at[at, i, 0].set(token, mode="drop")


def mixed_program(w, draft_w, vocab, cache, dcache, state, base_key, stop_ids, waiting,
                  waves: Waves, prefilling_C, *, cfg: TargetConfig, sampling: Sampling,
                  steps: int, window: int, rows_impl: str, every: int):
    """The waves' mixed steps, then plain steps to `steps` in all (`engine._decode`'s) ->
    (cache, dcache, state, tokens [C, steps + every, 1], None, steps run).
    `prefilling_C`: the prompt length of each row being prefilled (-1: not)."""
    c = state.token.shape[0]
    prefilling = prefilling_C >= 0
    state = dataclasses.replace(state, active=state.active & ~prefilling,
                                position=jnp.where(prefilling, prefilling_C, state.position))
    out = jnp.full((c, steps + every, 1), -1, jnp.int32)  # the plain steps may run to
    # a multiple of `every` past the waves
    live_at_start = state.active

    def wave(carry):
        i, cache, s, out = carry
        hidden_a, hidden_b, cache = forward(w, cfg, s, waves.tokens[i], waves.rows[i],
                                            waves.starts[i], cache, window=window,
                                            rows_impl=rows_impl)
        s, out = decoded(w, hidden_a, s, out, i, base_key, stop_ids, sampling)
        s, out = started(w, hidden_b, s, out, i, waves, base_key, stop_ids, sampling)
        return i + 1, cache, s, out

    def more(carry):
        i, _, s, _ = carry
        return (i < waves.count) & ~refill_due(waiting, live_at_start, s.active)

    i, cache, state, out = jax.lax.while_loop(more, wave, (0, cache, state, out))

    def body(j, carry):
        cache, s, out = carry
        o, cache = row_cache.forward_rows(w, cfg, s.token[:, None], s.position[:, None], cache,
                                       window=window, rows_impl=rows_impl)
        s, out = decoded(w, o.hidden_BxTxD[:, 0], s, out, i + j, base_key, stop_ids, sampling)
        return cache, s, out

    rest = jnp.where(i < waves.count, 0, steps - i)  # none after waves that ended early
    ran, cache, state, out = run_steps(body, (cache, state, out), rest, waiting, state_at=1,
                                       every=every)
    return cache, dcache, state, out, None, i + ran


@functools.cache
def program(tcfg: TargetConfig, sampling: Sampling, rows_impl: str, every: int):
    """The jitted mixed program of one target, sampling rule, cache attention and steps
    between checks, shared by every engine of the process (`engine._programs`' way)."""
    return Program(functools.partial(mixed_program, cfg=tcfg, sampling=sampling,
                                     rows_impl=rows_impl, every=every),
                   "mixed.step", static_argnames=("steps", "window"), donate_argnums=(3, 5))


@dataclasses.dataclass
class Plan:
    """Host side of a program's waves: the arrays and, per wave, its pieces (row, start)."""

    waves: Waves
    prefilling: np.ndarray  # [C]
    pieces: list[list[tuple[int, int]]]


def plan(prompts: dict[int, tuple[Any, int]], c: int, g: int, t: int, steps: int) -> Plan:
    """Pieces of the prompts being prefilled ({row: (request, first slot not yet written)},
    first come first served) packed G to a wave, at most `steps` waves."""
    w = steps
    tokens = np.zeros((w, g, t), np.int32)
    rows = np.full((w, g), c, np.int32)
    starts, lengths = np.zeros((w, g), np.int32), np.ones((w, g), np.int32)
    limits, seeds = np.ones((w, g), np.int32), np.zeros((w, g), np.uint32)
    prefilling = np.full((c,), -1, np.int32)
    pieces: list[list[tuple[int, int]]] = [[] for _ in range(w)]
    n = 0
    for row, (request, start) in prompts.items():
        prompt = request.prompt
        prefilling[row] = len(prompt)
        for s in range(start, len(prompt), t):
            if n == w * g:
                break
            k, j = divmod(n, g)
            piece = list(prompt[s: s + t])
            tokens[k, j, : len(piece)] = piece
            rows[k, j], starts[k, j], lengths[k, j] = row, s, len(prompt)
            limits[k, j] = request.max_new_tokens
            seeds[k, j] = np.uint32(request.seed & 0xFFFFFFFF)
            pieces[k].append((row, s))
            n += 1
    count = -(-n // g)
    waves = Waves(tokens, rows, starts, lengths, limits, seeds, np.int32(count))
    return Plan(waves, prefilling, pieces[:count])
