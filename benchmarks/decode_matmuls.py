"""The dense matmuls of one decode step alone, against the bytes they must read (issue 22).

A decode step of M rows multiplies [M, D] activations by every layer's weights; at small M the
time is the weights' reads. This times each part over all layers of a shape (random bf16
weights, a different matrix per layer so nothing stays in the L2), as the engine writes it
(q, k and v apart; gate and up apart) and fused (q|k|v one matrix, gate|up one matrix), at
several M, with XLA's matmul or (--impl pallas) decode/skinny_matmul's kernel over
CONFIGS' tilings. M = rows + a prompt chunk's tokens tells what a decode step costs when a chunk of
prefill rides along in it (chunked prefill): at the bound, the time does not grow with M.

    python benchmarks/decode_matmuls.py --config benchmarks/configs/llama-3.1-8b-instruct.json \\
        --rows 32,64,128,256,384 --json /tmp/matmuls.json
    XLA_FLAGS=--xla_gpu_enable_triton_gemm=false python benchmarks/decode_matmuls.py ...
    python benchmarks/decode_matmuls.py ... --rows 16,32,64 --impl xla,pallas --skip qkv,gate_up
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

from eagle3kit.core.config import TargetConfig
from eagle3kit.decode import skinny_matmul

CONFIGS = [skinny_matmul.SkinnyBlocks(block_n=n, block_k=k, num_warps=w, num_stages=st)
           for n in (64, 128, 256) for k in (64, 128, 256) for w, st in ((4, 4), (4, 6), (8, 4))]
BANDWIDTH = {"NVIDIA H200": 4.8e12, "NVIDIA H100 80GB HBM3": 3.35e12}


def parts(cfg: TargetConfig) -> dict[str, list[tuple[int, int]]]:
    """Each part's matrices (in, out), as the engine multiplies them and fused."""
    d, f, h = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    q, kv = cfg.num_heads * h, cfg.num_kv_heads * h
    return {"qkv": [(d, q), (d, kv), (d, kv)], "qkv_fused": [(d, q + 2 * kv)],
            "o": [(q, d)],
            "gate_up": [(d, f), (d, f)], "gate_up_fused": [(d, 2 * f)], "down": [(f, d)]}


def timed(fn, *args, repeats: int) -> float:
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t)
    return float(np.median(times))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", required=True)
    ap.add_argument("--rows", default="32,64,128,256,384")
    ap.add_argument("--layers", type=int, default=0, help="0: the config's")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--impl", default="xla", help="xla, pallas (decode/skinny_matmul's tiles "
                    "in CONFIGS) or both")
    ap.add_argument("--skip", default="", help="parts not timed, e.g. qkv,gate_up")
    ap.add_argument("--json", default="")
    a = ap.parse_args()
    cfg = TargetConfig.from_hf_config(json.load(open(a.config)))
    layers = a.layers or cfg.num_layers
    dev = jax.devices()[0]
    bw = BANDWIDTH.get(dev.device_kind, 0.0)
    key = jax.random.PRNGKey(0)
    results = []
    impls = a.impl.split(",")
    for name, mats in parts(cfg).items():
        if name in a.skip.split(","):
            continue
        ws = [[jax.random.normal(jax.random.fold_in(key, 100 * layer + i), m, jnp.bfloat16) * 0.02
               for i, m in enumerate(mats)] for layer in range(layers)]
        nbytes = sum(2 * i * o for i, o in mats) * layers
        variants = [("xla", None)] if "xla" in impls else []
        if "pallas" in impls:
            variants += [(f"pallas {b.block_n}x{b.block_k} split {b.split or 'auto'} "
                          f"w{b.num_warps} s{b.num_stages}", b) for b in CONFIGS
                         if all(skinny_matmul.fits(i, o, b) for i, o in mats)]
        for impl, blocks in variants:
            def matmul(x, w, blocks=blocks):
                return x @ w if blocks is None else skinny_matmul.skinny_matmul(x, w, blocks)

            @jax.jit
            def run(x, ws, matmul=matmul):
                out = []
                for lw in ws:  # unrolled, as the engine's layer loop
                    out.append(sum(jnp.sum(matmul(x, w), axis=-1) for w in lw))
                return jnp.stack(out)

            for m in [int(r) for r in a.rows.split(",")]:
                x = jax.random.normal(key, (m, mats[0][0]), jnp.bfloat16)
                try:
                    s = timed(run, x, ws, repeats=a.repeats)
                except Exception as e:  # a tile the card cannot hold: say so, go on
                    print(json.dumps({"part": name, "impl": impl, "rows": m,
                                      "error": str(e).splitlines()[0][:200]}), flush=True)
                    continue
                row = {"part": name, "impl": impl, "rows": m, "ms": round(1e3 * s, 3),
                       "GB": round(nbytes / 1e9, 2),
                       "share": round(nbytes / bw / s, 3) if bw else None}
                results.append(row)
                print(json.dumps(row), flush=True)
        del ws
    if a.json:
        json.dump({"device": dev.device_kind, "jax": jax.__version__, "results": results},
                  open(a.json, "w"), indent=1)


if __name__ == "__main__":
    main()
