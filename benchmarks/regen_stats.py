"""What a regenerate run made (benchmarks/gpu_session.sh regen2): its rate, how its answers
ended, and how many distinct tokens the draft would train on, against the original data.

    python benchmarks/regen_stats.py --log regen.log --records regen-train.jsonl \
        --tokens regenerated=train.jsonl --tokens original=orig-tokens.jsonl

--log     regenerate's stderr, of one call or several (a resumed run): the summary lines are
          summed (answers by finish reason, generated tokens, seconds of generation)
--records the regenerated records: the kept answers by finish reason, samples per conversation
--tokens  NAME=FILE token records: distinct token ids under the loss mask (what vocab-select
          counts) and assistant tokens
"""

from __future__ import annotations

import argparse
import collections
import json
import re

SUMMARY = re.compile(r"regenerate: .*?([\d,]+) answers \(([\d,]+) tokens(?:; ended by ([^)]*))?\)"
                     r".*?over ([\d,.]+)s")


def number(text: str) -> float:
    return float(text.replace(",", ""))


def log_totals(path: str) -> None:
    answers = tokens = seconds = 0.0
    reasons: collections.Counter = collections.Counter()
    calls = 0
    for line in open(path, errors="replace"):
        m = SUMMARY.search(line)
        if not m:
            continue
        calls += 1
        answers += number(m[1])
        tokens += number(m[2])
        seconds += number(m[4])
        for part in (m[3] or "").split(", "):
            if part:
                n, reason = part.split(" ", 1)
                reasons[reason] += int(number(n))
    print(f"generation ({calls} calls): {answers:,.0f} answers, {tokens:,.0f} tokens in "
          f"{seconds:,.0f} s = {tokens / max(seconds, 1e-9):,.0f} tokens/s")
    for reason, n in reasons.most_common():
        print(f"  finish {reason:<11} {n:>9,} ({n / max(answers, 1):.1%})")


def record_totals(path: str) -> None:
    reasons: collections.Counter = collections.Counter()
    samples: collections.Counter = collections.Counter()
    records = 0
    for line in open(path):
        r = json.loads(line)
        records += 1
        g = r["generation"]
        samples[r["id"].rsplit("#s", 1)[0] if g.get("samples", 1) > 1 else r["id"]] += 1
        reasons.update(t["finish_reason"] for t in g["turns"])
    answers = sum(reasons.values())
    print(f"records: {records:,} ({len(samples):,} conversations); kept answers {answers:,}: "
          + ", ".join(f"{n:,} {k} ({n / answers:.1%})" for k, n in reasons.most_common()))


def token_totals(name: str, path: str) -> None:
    distinct: set[int] = set()
    masked = records = 0
    for line in open(path):
        r = json.loads(line)
        records += 1
        ids = [t for t, m in zip(r["input_ids"], r["loss_mask"], strict=True) if m]
        masked += len(ids)
        distinct.update(ids)
    print(f"{name}: {records:,} token records, {masked:,} assistant tokens, "
          f"{len(distinct):,} distinct assistant tokens")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--log")
    p.add_argument("--records")
    p.add_argument("--tokens", action="append", default=[], metavar="NAME=FILE")
    a = p.parse_args()
    if a.log:
        log_totals(a.log)
    if a.records:
        record_totals(a.records)
    for spec in a.tokens:
        name, _, path = spec.partition("=")
        token_totals(name, path)


if __name__ == "__main__":
    main()
