"""Helpers of the original-vs-regenerated comparison (benchmarks/gpu_session.sh regtrain/regeval).

    split DIR         DIR/chats.jsonl + DIR/regen.jsonl -> orig-chats.jsonl and regen-chats.jsonl
                      holding the same conversation ids (those regenerate wrote)
    heldout DIR V     DIR/V-tokens.jsonl -> V-train.jsonl and V-heldout.jsonl: every 50th id
                      (by a hash of the id, the same ids for both versions) is held out
    table OUT         the Markdown table of OUT/eval-*.json
"""

from __future__ import annotations

import json
import sys
import zlib
from pathlib import Path


def held_out(cid: str) -> bool:
    return zlib.crc32(cid.encode()) % 50 == 0


def split(d: Path) -> None:
    # a run stopped by a kill may end in a torn line: complete lines only
    regen = (d / "regen.jsonl").read_text().splitlines(keepends=True)
    regen = [line.rstrip("\n") for line in regen if line.endswith("\n")]
    ids = {json.loads(line)["id"] for line in regen}
    orig = [line for line in (d / "chats.jsonl").read_text().splitlines()
            if json.loads(line)["id"] in ids]
    (d / "orig-chats.jsonl").write_text("\n".join(orig) + "\n")
    (d / "regen-chats.jsonl").write_text("\n".join(regen) + "\n")
    print(f"{len(orig)} conversations in both versions", file=sys.stderr)


def heldout(d: Path, v: str) -> None:
    lines = (d / f"{v}-tokens.jsonl").read_text().splitlines()
    train = [x for x in lines if not held_out(json.loads(x)["id"])]
    test = [x for x in lines if held_out(json.loads(x)["id"])]
    (d / f"{v}-train.jsonl").write_text("\n".join(train) + "\n")
    (d / f"{v}-heldout.jsonl").write_text("\n".join(test) + "\n")
    print(f"{v}: {len(train)} train, {len(test)} held out", file=sys.stderr)


def table(out: Path) -> None:
    print("| trained on | held-out original acc_0 / tau | held-out regenerated acc_0 / tau "
          "| MT-bench tau | speedup |")
    print("|---|---|---|---|---|")
    for v in ("orig", "regen"):
        r = {h: json.loads((out / f"eval-{v}-on-{h}.json").read_text()) for h in
             ("orig", "regen")}
        mt = json.loads((out / f"eval-{v}-mtbench.json").read_text())
        cells = [f"{r[h]['acc'][0]:.3f} / {r[h]['tau']:.2f}" for h in ("orig", "regen")]
        name = {"orig": "original ShareGPT", "regen": "regenerated ShareGPT"}[v]
        print(f"| {name} | {cells[0]} | {cells[1]} | {mt['tau_generate']:.2f} | "
              f"{mt['speedup']:.2f}x |")


if __name__ == "__main__":
    cmd, *rest = sys.argv[1:]
    {"split": lambda: split(Path(rest[0])), "heldout": lambda: heldout(Path(rest[0]), rest[1]),
     "table": lambda: table(Path(rest[0]))}[cmd]()
