"""Times loading a GGUF target the way `regenerate` and `train` load it, phase by phase.

    python benchmarks/load_gguf.py MODEL.gguf [--dtype bfloat16|float32] [--mesh data=1,tensor=1]

Phases (each printed in seconds):
  header      resolve_target: the GGUF header, the config, the tensor table
  dequantize  every tensor dequantised alone, as the loader does it (on the device where
              io.gguf can, its programs compiled by a first pass, else by the `gguf`
              package on the host), waited for
  load        load_target: dequantisation, the layout (transposes, stacking, casts), the
              transfer; the first call also compiles the loader's programs (cold), the second
              does not (warm)
  layout      warm load minus dequantize: what the layout and the transfer add
The model's own programs (forward, decode) are not compiled here.
"""

from __future__ import annotations

import argparse
import time

import jax
import numpy as np

from eagle3kit.core.sharding import make_mesh
from eagle3kit.io.hf import load_target, resolve_target
from eagle3kit.jobs.common import DTYPES


def _dequantize_all(src) -> None:
    on_device = getattr(src, "device_tensor", None)
    for name in src.names:
        if on_device is not None:
            jax.block_until_ready(on_device(name))
        else:
            np.asarray(src.get(name))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("gguf")
    ap.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    ap.add_argument("--mesh", default=None)
    args = ap.parse_args()
    print(f"{jax.device_count()} x {jax.devices()[0].device_kind}, dtype {args.dtype}")

    t = time.perf_counter()
    ckpt = resolve_target(args.gguf)
    header = time.perf_counter() - t
    print(f"header      {header:8.2f} s  ({len(ckpt.source.names)} tensors)")

    runs = []
    for _ in range(2 if hasattr(ckpt.source, "device_tensor") else 1):
        t = time.perf_counter()
        _dequantize_all(ckpt.source)
        runs.append(time.perf_counter() - t)
    dequant = runs[-1]
    print(f"dequantize  {dequant:8.2f} s" + ("  (on the device, compiled before)"
                                             if len(runs) > 1 else "  (host)"))

    mesh = make_mesh(args.mesh)
    times = []
    for _ in range(2):
        t = time.perf_counter()
        weights = jax.block_until_ready(load_target(ckpt, mesh, DTYPES[args.dtype]))
        times.append(time.perf_counter() - t)
        del weights
    print(f"load cold   {times[0]:8.2f} s  (with the loader's compiles)")
    print(f"load warm   {times[1]:8.2f} s")
    print(f"layout      {times[1] - dequant:8.2f} s  (warm load - dequantize)")
    print(f"total       {header + times[0]:8.2f} s  (header + cold load)")


if __name__ == "__main__":
    main()
