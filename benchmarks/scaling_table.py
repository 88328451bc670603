"""The scaling table of `benchmarks/multi_gpu.sh scale`: `train_step.py` outputs, one file per
(target, mesh), named TARGET__MESH.txt with the mesh's '=' dropped and ',' as '.' (data=2,tensor=2
is data2.tensor2), as one markdown table; each target's rows against its first file's first row
(the one-GPU run).

    python benchmarks/scaling_table.py out/scale/8b__1gpu.txt out/scale/8b__data4.txt ...
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

ROW = re.compile(r"^\s*(\d+)\s+(\w+)\s+([\d.]+)\s+([\d.]+)\s+([\d,]+)\s+([\d.]+)\s+(\S+)\s+"
                 r"([\d.]+)\s+([\d.]+)\s+([\d,]+)\s*$")


def main(paths: list[str]) -> None:
    print("| target | mesh | GPUs | rows | compile s | step ms | tokens/s | piped tokens/s "
          "| vs 1 GPU | per GPU | MFU per GPU | peak GiB |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    base: dict[str, float] = {}
    for path in paths:
        target, _, name = Path(path).stem.partition("__")
        mesh = ",".join(re.sub(r"^([a-z]+)(\d+)$", r"\1=\2", part) for part in name.split("."))
        text = Path(path).read_text()
        gpus = re.search(r"device: (\d+) x", text)
        n = int(gpus.group(1)) if gpus else 0
        rows = [m.groups() for m in map(ROW.match, text.splitlines()) if m]
        errors = [x.strip() for x in text.splitlines() if "failed:" in x or "Error" in x]
        if errors:  # a failed row (OOM at a batch) or a failed run: its first error line
            print(f"| {target} | {mesh} | {n} | | | | {errors[0][:100]} | | | | | |")
        for b, _, compile_s, step, tps, _, mfu, peak, _, piped in rows:
            rate = float(tps.replace(",", ""))
            base.setdefault(target, rate)
            x = rate / base[target]
            print(f"| {target} | {mesh} | {n} | {b} | {compile_s} | {step} | {tps} | {piped} "
                  f"| {x:.2f}x | {x / max(n, 1):.0%} | {mfu} | {peak} |")


if __name__ == "__main__":
    main(sys.argv[1:])
