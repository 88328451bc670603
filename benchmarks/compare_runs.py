"""Two `train` runs of one recipe (e.g. one process driving 4 GPUs, and 4 processes of one GPU
each through jax.distributed): their logged steps side by side, and how far apart their final
drafts are.

    python benchmarks/compare_runs.py runs/one runs/many
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import jax
import numpy as np

from eagle3kit.io.draft_io import load_draft

KEYS = ("loss", "grad_norm", "tokens", "tau")


def records(run: Path) -> list[dict]:
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("a", type=Path)
    p.add_argument("b", type=Path)
    args = p.parse_args()
    ra, rb = records(args.a), records(args.b)
    print(f"| step | {' | '.join(f'{k} A | {k} B' for k in KEYS)} |")
    print("|---" * (1 + 2 * len(KEYS)) + "|")
    worst = {k: 0.0 for k in KEYS}
    for x, y in zip(ra, rb, strict=False):
        label = f"{x['step']}{' (eval)' if x.get('eval') else ''}"
        cells = []
        for k in KEYS:
            cells += [str(x.get(k, "")), str(y.get(k, ""))]
            if k in x and k in y:
                worst[k] = max(worst[k], abs(x[k] - y[k]))
        print(f"| {label} | {' | '.join(cells)} |")
    print(f"logged records: {len(ra)} vs {len(rb)}; largest difference: "
          + ", ".join(f"{k} {v:.3g}" for k, v in worst.items()))
    da, db = load_draft(args.a / "final"), load_draft(args.b / "final")
    xs = [np.asarray(v) for v in jax.tree.leaves(da.weights)]
    ys = [np.asarray(v) for v in jax.tree.leaves(db.weights)]
    same = len(xs) == len(ys) and all(np.array_equal(x, y) for x, y in zip(xs, ys, strict=True))
    diff = max(float(np.abs(x.astype(np.float64) - y).max()) for x, y in zip(xs, ys, strict=True))
    scale = max(float(np.abs(x).max()) for x in xs)
    print(f"final drafts ({sum(x.size for x in xs):,} weights): "
          + ("bit-identical" if same else f"largest |difference| {diff:.3g} "
             f"(largest |weight| {scale:.3g})"))


if __name__ == "__main__":
    main()
