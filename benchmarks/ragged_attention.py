"""Decode/verify attention alone on a GPU: decode/ragged_attention's kernel (each row's keys
read in place up to its own length) against the XLA path (the cache's first `window` slots
copied out, the mask built), its rows gathered (a subset of rows in any order: the engine's
prefill pieces) or sliced (every row in order: the engine's decode and verify steps; timed
only, on the same cache, since the rows differ).

    python benchmarks/ragged_attention.py                     # check + time, all shapes
    python benchmarks/ragged_attention.py --shapes llama8b-4096 --blocks 64,64,4,2 128,64,8,3
    python benchmarks/ragged_attention.py --shapes llama8b-1row-4096 --blocks 64,64,4,2,1

First each path's error in bf16 against the XLA path in fp32 (ragged rows, a tree mask, a
sliding window with sinks), then one line a shape and path: milliseconds a call, the bytes a
call must read (every row's keys and values up to its own length, plus queries and outputs),
those bytes over the time (GB/s) and that as a share of the card's HBM bandwidth. The XLA
path's window is the longest row rounded up to 256 slots, as the engine buckets it; rows'
lengths are uniform in [1, S - T]. Verify shapes carry a tree mask, the prefill piece is
causal. One layer's cache: a model step runs this once a layer.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

from eagle3kit.decode.ragged_attention import RaggedBlocks, attend_rows

SHAPES = {  # name: (rows B = C, new tokens T, N, K, H, slots S, window, sinks)
    "llama8b-2048": (128, 1, 32, 8, 128, 2048, 0, False),
    "llama8b-4096": (128, 1, 32, 8, 128, 4096, 0, False),
    "llama8b-4096-verify8": (128, 8, 32, 8, 128, 4096, 0, False),
    "smollm2-2048": (512, 1, 9, 3, 64, 2048, 0, False),
    "smollm2-2048-verify8": (512, 8, 9, 3, 64, 2048, 0, False),
    "smollm2-8rows-verify4": (8, 4, 9, 3, 64, 2048, 0, False),  # batched spec decoding
    "llama8b-1row-4096": (1, 1, 32, 8, 128, 4096, 0, False),  # split rows (flash decoding)
    "gptoss-window128": (64, 4, 64, 8, 64, 4096, 128, True),
    "llama8b-4096-piece256": (32, 256, 32, 8, 128, 4096, 0, False),  # a prefill piece
    "tiny": (4, 3, 4, 2, 16, 64, 8, True),  # a smoke test off GPUs (interpret mode)
}
BANDWIDTH = {"NVIDIA H200": 4.8e12, "NVIDIA H100 80GB HBM3": 3.35e12}
GPU = jax.default_backend() == "gpu"


def inputs(b, t, n, kh, h, s, dtype, seed=0):
    """q, the caches (rows in shuffled order), each row's prefix and positions, and for
    T <= 64 a tree mask (every token's parent one of the two before it); longer T is a
    prefill piece (causal, mask None)."""
    rng = np.random.default_rng(seed)
    prefix = rng.integers(1, s - t + 1, size=b)
    rows = rng.permutation(b)
    parent = [-1] + [j - 1 if t > 64 else int(rng.integers(max(0, j - 2), j))
                     for j in range(1, t)]
    mask = np.eye(t, dtype=bool)
    depth = np.zeros(t, np.int64)
    for j in range(1, t):
        mask[j] |= mask[parent[j]]
        depth[j] = depth[parent[j]] + 1
    key = jax.random.key(seed)
    kq, kk, kv, ks = jax.random.split(key, 4)
    return dict(q=jax.random.normal(kq, (b, t, n, h), dtype),
                k=jax.random.normal(kk, (b, s, kh, h), dtype),
                v=jax.random.normal(kv, (b, s, kh, h), dtype),
                rows=jnp.asarray(rows, jnp.int32), prefix=jnp.asarray(prefix, jnp.int32),
                positions=jnp.asarray(prefix[:, None] + depth, jnp.int32),
                mask=jnp.asarray(np.broadcast_to(mask, (b, t, t))) if t <= 64 else None,
                sinks=jax.random.normal(ks, (n,), jnp.float32))


def make_call(path: str, shape, blocks: RaggedBlocks | None, x):
    """A jitted call of one path on the inputs x (the XLA path on the bucketed window)."""
    b, t, n, kh, h, s, window, sinks = shape
    longest = int(x["prefix"].max()) + t
    bucket = min(s, -(-longest // 256) * 256)

    def call(q, k, v, rows, prefix, positions, mask, sink_n):
        if path.startswith("xla"):
            k, v = k[:, :bucket], v[:, :bucket]
        return attend_rows(q, k, v, None if path == "xla-sliced" else rows, prefix, positions,
                           block_mask_BxTxT=mask, window=window, scale=h ** -0.5,
                           sinks_N=sink_n if sinks else None,
                           impl="pallas" if path == "pallas" else "xla", blocks=blocks)

    f = jax.jit(call)
    args = [x[a] for a in ("q", "k", "v", "rows", "prefix", "positions", "mask", "sinks")]
    return lambda: f(*args)


def bytes_read(shape, x) -> int:
    """What a call must read and write: each row's keys and values up to its length (inside
    its window when there is one), the queries and the outputs."""
    b, t, n, kh, h, s, window, _ = shape
    lengths = np.asarray(x["prefix"]) + t
    if window:
        lengths = np.minimum(lengths, window + t)
    item = x["k"].dtype.itemsize
    return int(lengths.sum()) * 2 * kh * h * item + 2 * b * t * n * h * item


def check(shape, blocks) -> None:
    x32 = inputs(*shape[:6], jnp.float32, seed=1)
    ref = np.asarray(make_call("xla", shape, None, x32)(), np.float32)
    for path in ("pallas", "xla"):
        x = jax.tree.map(lambda a: a.astype(jnp.bfloat16) if a.dtype == jnp.float32 else a, x32)
        x["sinks"] = x32["sinks"]
        err = np.abs(np.asarray(make_call(path, shape, blocks, x)(), np.float32) - ref)
        print(f"  bf16 {path:>6} vs fp32 xla: max abs {err.max():.2e}, mean {err.mean():.2e}")
    if GPU:  # the kernel in fp32 against the XLA path in fp32: summation order only
        err = np.abs(np.asarray(make_call("pallas", shape, blocks, x32)(), np.float32) - ref)
        print(f"  fp32 pallas vs fp32 xla: max abs {err.max():.2e}")


def timed(call, reps: int) -> float:
    """Milliseconds a call, calls queued back to back after a compiling warm-up."""
    jax.block_until_ready(call())
    start = time.perf_counter()
    for _ in range(reps):
        out = call()
    jax.block_until_ready(out)
    return (time.perf_counter() - start) / reps * 1e3


def attempt(what: str, failures: list, fn, *args):
    """fn(*args)'s result, or None after printing the error's first line: one shape or tile
    setting that fails to compile must not hide the others (the exit status tells)."""
    try:
        return fn(*args)
    except Exception as e:  # noqa: BLE001 - any compile or run error of this one case
        first = (str(e).strip().splitlines() or [""])[0]
        print(f"  FAILED {what}: {type(e).__name__}: {first}", flush=True)
        failures.append(what)
        return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="*",
                        default=[s for s in SHAPES if s != "tiny"] if GPU else ["tiny"])
    parser.add_argument("--blocks", nargs="*", default=["64,64,4,2"],
                        help="kernel tiles k,q,num_warps,num_stages[,split] (one run each; "
                             "split 0 or left out: automatic)")
    parser.add_argument("--reps", type=int, default=50 if GPU else 2)
    args = parser.parse_args()
    names = ("k", "q", "num_warps", "num_stages", "split")
    settings = [RaggedBlocks(**dict(zip(names, map(int, spec.split(",")), strict=False)),
                             interpret=not GPU) for spec in args.blocks]
    device = jax.devices()[0].device_kind
    bandwidth = BANDWIDTH.get(device)
    print(f"# ragged decode/verify attention, one layer, bf16, on {device}")
    failures: list[str] = []
    for name in args.shapes:
        shape = SHAPES[name]
        print(f"\n## {name}: rows {shape[0]}, T {shape[1]}, heads {shape[2]}/{shape[3]}, "
              f"head dim {shape[4]}, slots {shape[5]}, window {shape[6]}, sinks {shape[7]}",
              flush=True)
        attempt(f"{name} check", failures, check, shape, settings[0])
        x = inputs(*shape[:6], jnp.bfloat16)
        need = bytes_read(shape, x)
        print("| path | ms | GB read | GB/s | share of HBM bandwidth |")
        print("|---|---|---|---|---|")
        for label, path, blocks in ([("xla (window copied, rows gathered)", "xla", None),
                                     ("xla (window copied, rows sliced)", "xla-sliced", None)]
                                    + [(f"pallas {b.k},{b.q},{b.num_warps},{b.num_stages},"
                                        f"{b.split}",
                                        "pallas", b) for b in settings]):
            ms = attempt(f"{name} {label}", failures,
                         lambda *a: timed(make_call(*a), args.reps), path, shape, blocks, x)
            if ms is None:
                print(f"| {label} | failed | {need / 1e9:.3f} | - | - |", flush=True)
                continue
            rate = need / (ms * 1e-3)
            share = f"{rate / bandwidth:.0%}" if bandwidth else "-"
            print(f"| {label} | {ms:.3f} | {need / 1e9:.3f} | {rate / 1e9:.0f} | {share} |",
                  flush=True)
    if failures:
        raise SystemExit(f"{len(failures)} failed: " + "; ".join(failures))


if __name__ == "__main__":
    main()
