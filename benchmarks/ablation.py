"""Helpers of the acceptance ablation (benchmarks/ablation.sh; docs/benchmarks.md, "What each
lever gives").

    split TOKENS NAME DIR   TOKENS (token records) -> DIR/NAME-train.jsonl, DIR/NAME-heldout.jsonl:
                            a conversation is held out when a hash of its source id (the id
                            before regenerate's `#s<k>`) says so, so every version of the data,
                            every sample of it, holds out the same conversations (2%)
    sample0 IN OUT          the records of sample 0 (`#s0`) of a several-sample regeneration,
                            ids without the suffix: what one sample per conversation gives
    best-loss DIR A B ...   the loss of the arm (DIR/A/eval-orig.json, ...) with the highest
                            held-out tau; prints its name
    table DIR ARM ...       the Markdown table of every arm's results in DIR/ARM/
"""

from __future__ import annotations

import json
import os
import re
import sys
import zlib
from pathlib import Path

SUFFIX = re.compile(r"#s\d+$")


def source_id(cid: str) -> str:
    return SUFFIX.sub("", cid)


EVERY = int(os.environ.get("HOLDOUT_EVERY", "50"))  # 1 in EVERY conversations held out


def held_out(cid: str) -> bool:
    return zlib.crc32(source_id(cid).encode()) % EVERY == 0


def split(tokens: Path, name: str, out: Path) -> None:
    train, test = [], []
    with tokens.open() as f:
        for line in f:
            (test if held_out(json.loads(line)["id"]) else train).append(line)
    (out / f"{name}-train.jsonl").write_text("".join(train))
    (out / f"{name}-heldout.jsonl").write_text("".join(test))
    print(f"{name}: {len(train)} train, {len(test)} held out", file=sys.stderr)


def sample0(src: Path, dst: Path) -> None:
    kept = []
    with src.open() as f:
        for line in f:
            r = json.loads(line)
            if r["id"].endswith("#s0"):
                r["id"] = source_id(r["id"])
                kept.append(json.dumps(r, ensure_ascii=False) + "\n")
    dst.write_text("".join(kept))
    print(f"sample 0: {len(kept)} records", file=sys.stderr)


def _load(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None


def _decode_rows(*paths: Path) -> dict[str, dict]:
    """decode_speed.py --json rows by shape (the lines that are JSON objects with a shape)."""
    rows = {}
    for path in paths:
        for line in path.read_text().splitlines():
            if line.startswith("{"):
                r = json.loads(line)
                if "shape" in r:
                    rows[r["shape"]] = r
    return rows


def best_loss(d: Path, arms: list[str]) -> None:
    scored = []
    for arm in arms:
        r = _load(d / arm / "eval-orig.json")
        cfg = _load(d / arm / "run" / "config.json") or {}
        if r:
            scored.append((r["tau"], cfg.get("loss", "kl"), arm))
    print(max(scored)[1] if scored else "kl")


def table(d: Path, arms: list[str]) -> None:
    print("| arm | data | held-out acc_0..6 (original) | tau orig | tau regen | MT-bench tau "
          "K=3 pooled/req | K=7 | 5/4/8 | speedup K=3 / K=7 / tree | HumanEval tau K=7 "
          "| train min | steps |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for arm in arms:
        a = d / arm
        orig, regen = _load(a / "eval-orig.json"), _load(a / "eval-regen.json")
        mt = _decode_rows(*sorted(a.glob("mtbench*.txt")))
        he = _decode_rows(*a.glob("humaneval.txt"))
        final = _load(a / "run" / "final" / "draft_config.json") or {}
        t = final.get("training", {})
        accs = " ".join(f"{x * 100:.1f}" for x in orig["acc"]) if orig else "-"

        def tau(rows, shape):
            r = rows.get(shape)
            return f"{r['tau_pooled']:.2f}/{r['tau_per_request_mean']:.2f}" if r else "-"

        def held(r):
            return f"{r['tau']:.2f}" if r else "-"

        speed = " / ".join(f"{mt[s]['speedup']:.2f}x" if "speedup" in mt.get(s, {}) else "-"
                           for s in ("3", "7", "5/4/8"))
        he7 = f"{next(iter(he.values()))['tau_pooled']:.2f}" if he else "-"
        minutes = f"{t['wall_time_s'] / 60:.1f}" if "wall_time_s" in t else "-"
        print(f"| {arm} | {Path(str(t.get('data', '-'))).name} | {accs} "
              f"| {held(orig)} | {held(regen)} | {tau(mt, '3')} | {tau(mt, '7')} "
              f"| {tau(mt, '5/4/8')} | {speed} | {he7} | {minutes} | {t.get('steps', '-')} |"
              if orig or mt else f"| {arm} | (incomplete) |||||||||||")


if __name__ == "__main__":
    cmd, *rest = sys.argv[1:]
    if cmd == "split":
        split(Path(rest[0]), rest[1], Path(rest[2]))
    elif cmd == "sample0":
        sample0(Path(rest[0]), Path(rest[1]))
    elif cmd == "best-loss":
        best_loss(Path(rest[0]), rest[1:])
    elif cmd == "table":
        table(Path(rest[0]), rest[1:])
    else:
        raise SystemExit(f"unknown command {cmd}")
