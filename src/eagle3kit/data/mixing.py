"""`mix`: weighted, seeded sampling of chat sources into one stream of `ChatRecord`s.

With `-n N`, the weights are shares of N (largest-remainder rounding, so the counts add up to
exactly N). Each source is read once, as a stream; every usable record draws a random key
from a generator seeded by (seed, source index) and the source keeps the records with the
smallest keys in a bounded heap: sampling without replacement whose memory is the output,
not the input, and whose result depends only on the seed and the data. A source with fewer
usable records than its share is an error, unless `allow_repeat` (then every record is
repeated equally often and the remainder is sampled).

Without `-n`, every usable record is written once, sources interleaved in proportion to
their weights, as they stream (no memory beyond one record per source).

In both cases the output interleaves sources smoothly: the next record comes from the source
furthest behind its share.
"""

from __future__ import annotations

import collections
import dataclasses
import heapq
import random
from collections.abc import Callable, Iterator, Sequence

import msgspec

from eagle3kit.data.records import ChatRecord, display_name
from eagle3kit.data.sources import Reader, RecordError, SourceSpec, drop_reason, normalise
from eagle3kit.errors import InputError, plural


@dataclasses.dataclass
class SourceReport:
    """What happened to one source's records."""

    spec: SourceSpec
    read: int = 0
    used: int = 0
    dropped: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    invalid: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    notes: list[str] = dataclasses.field(default_factory=list)
    quota: int | None = None
    repeated: int = 0


def quotas(weights: Sequence[float], n: int) -> list[int]:
    """Integer shares of n proportional to weights, summing to n (largest remainder)."""
    total = sum(weights)
    exact = [w / total * n for w in weights]
    counts = [int(x) for x in exact]
    order = sorted(range(len(weights)), key=lambda i: (-(exact[i] - counts[i]), i))
    for i in order[: n - sum(counts)]:
        counts[i] += 1
    return counts


def usable(reader: Reader, report: SourceReport, fmt: str, skip_invalid: bool,
           progress: Callable[[SourceReport], None] | None = None) -> Iterator[ChatRecord]:
    """The source's normalised records that can train a draft; counts everything else."""
    for raw in reader:
        report.read += 1
        if progress is not None and report.read % 1000 == 0:
            progress(report)
        try:
            record = normalise(raw, fmt, report.spec.name)
        except RecordError as e:
            if not skip_invalid:
                raise InputError(f"{e} (pass --skip-invalid to skip such records)") from None
            report.invalid[e.reason] += 1
            continue
        reason = drop_reason(record)
        if reason is not None:
            report.dropped[reason] += 1
            continue
        report.used += 1
        yield record
    report.notes.extend(reader.notes)
    if report.read == 0:
        raise InputError("no records", path=display_name(report.spec.location))


def interleave(streams: Sequence[Iterator[ChatRecord]], weights: Sequence[float]
               ) -> Iterator[ChatRecord]:
    """Next record from the live stream with the smallest (taken + 0.5) / weight."""
    taken = [0] * len(streams)
    live = set(range(len(streams)))
    while live:
        i = min(live, key=lambda j: ((taken[j] + 0.5) / weights[j], j))
        try:
            record = next(streams[i])
        except StopIteration:
            live.discard(i)
            continue
        taken[i] += 1
        yield record


def sample(records: Iterator[ChatRecord], k: int, rng: random.Random
           ) -> tuple[list[ChatRecord], int]:
    """k records without replacement (the k smallest random keys), in key order, plus the
    number of records seen. Memory: k records."""
    heap: list[tuple[float, int, ChatRecord]] = []  # max-heap on key via negation
    seen = 0
    for seen, record in enumerate(records, start=1):
        key = rng.random()
        if len(heap) < k:
            heapq.heappush(heap, (-key, seen, record))
        elif -key > heap[0][0]:
            heapq.heapreplace(heap, (-key, seen, record))
    return [r for _, _, r in sorted(heap, key=lambda x: (-x[0], x[1]))], seen


def _repeat(chosen: list[ChatRecord], quota: int) -> list[ChatRecord]:
    """Every record quota // len times (ids suffixed #2, #3, ...), then the first of the
    (randomly ordered) records for the remainder."""
    copies, extra = divmod(quota, len(chosen))
    out = []
    for c in range(copies + 1):
        part = chosen if c < copies else chosen[:extra]
        out.extend(r if c == 0 else msgspec.structs.replace(r, id=f"{r.id}#{c + 1}")
                   for r in part)
    return out


def mix(specs: Sequence[SourceSpec], *, n: int | None, seed: int = 0, fmt: str = "auto",
        allow_repeat: bool = False, skip_invalid: bool = False,
        progress: Callable[[SourceReport], None] | None = None
        ) -> tuple[Iterator[ChatRecord], list[SourceReport]]:
    """The mixed stream and the per-source reports (complete once the stream is consumed);
    `progress(report)` is called every 1,000 records read.

    Raises `InputError` for unreadable sources, invalid records (unless `skip_invalid`) and,
    with `n`, sources too small for their share (unless `allow_repeat`).
    """
    if n is not None and n <= 0:
        raise InputError(f"-n must be positive, got {n}")
    reports = [SourceReport(s) for s in specs]
    weights = [s.weight for s in specs]
    if n is None:
        streams = [usable(Reader(s), r, fmt, skip_invalid, progress)
                   for s, r in zip(specs, reports, strict=True)]
        return interleave(streams, weights), reports

    def sampled() -> Iterator[ChatRecord]:
        chosen = []
        for i, (spec, report, quota) in enumerate(zip(specs, reports, quotas(weights, n), strict=True)):
            report.quota = quota
            rng = random.Random(f"eagle3kit-mix:{seed}:{i}")
            records = usable(Reader(spec), report, fmt, skip_invalid, progress)
            picked, seen = sample(records, quota, rng)
            if seen == 0:
                raise InputError("no usable records (see the counts above)",
                                 path=display_name(spec.location))
            if seen < quota:
                if not allow_repeat:
                    raise InputError(
                        f"only {plural(seen, 'usable record')}, but its share of -n {n:,} is "
                        f"{quota:,}; lower -n or this weight, or pass --allow-repeat",
                        path=display_name(spec.location))
                report.repeated = quota - seen
                picked = _repeat(picked, quota)
            chosen.append(iter(picked))
        yield from interleave(chosen, [max(q, 1) for q in quotas(weights, n)])

    return sampled(), reports
