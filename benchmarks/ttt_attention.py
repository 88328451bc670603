"""The TTT attention alone on a GPU: the fused Pallas kernel against the XLA path.

    python benchmarks/ttt_attention.py                # check + time, the real draft shapes
    python benchmarks/ttt_attention.py --blocks 64,64,64,64,4,2 128,64,64,64,4,2

First the error of one Llama-8B-shaped block (32 heads, 8 kv heads, H = 128, T = 2048,
packed documents, two diagonal steps) in bf16 against the XLA path in fp32, values and
gradients, beside the XLA path's own bf16 error; then the forward + backward time of all
K = 7 TTT steps' attention (step k: step-0 keys plus k diagonal keys) for the shapes of
docs/benchmarks.md, for main's choice (step 0 through cuDNN, steps 1..6 through the XLA
blocks), the kernel at each tile setting (q, k, bwd_q, bwd_k, warps, stages), and step 0
through cuDNN with steps 1..6 through the kernel at the first setting.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

from eagle3kit.core import flash, ttt
from eagle3kit.core.layers import attend, causal_mask

SHAPES = {  # name: (B, T, N, Kh, H), the drafts of the targets in benchmarks/configs
    "llama8b-2x2048": (2, 2048, 32, 8, 128),
    "smollm2-8x2048": (8, 2048, 9, 3, 64),
    "llama8b-1x8192": (1, 8192, 32, 8, 128),
    "tiny": (1, 256, 4, 2, 16),  # a smoke test off GPUs (interpret mode)
}
GPU = jax.default_backend() == "gpu"


def _inputs(b, t, n, kh, h, steps, dtype, seed=0):
    rng = np.random.default_rng(seed)
    seg = np.ones((b, t), np.int32)
    seg[:, t // 3:] = 2  # two documents a row
    arr = lambda *s: jnp.asarray(rng.standard_normal(s), dtype)  # noqa: E731
    return (arr(b, t, n, h), [arr(b, t, kh, h) for _ in range(steps)],
            [arr(b, t, kh, h) for _ in range(steps)], jnp.asarray(seg), arr(b, t, n, h))


def check(blocks: flash.FlashBlocks, shape=(1, 2048, 32, 8, 128)) -> None:
    q, keys, values, seg, ct = _inputs(*shape, 3, jnp.float32, seed=5)
    seg = seg.at[0, shape[1] * 15 // 16:].set(0)  # and a padded tail

    def run(impl, dtype):
        cast = lambda x: jax.tree.map(lambda a: a.astype(dtype), x)  # noqa: E731
        f = jax.jit(lambda q, k, v: jax.vjp(
            lambda *a: _attend(impl, blocks, *a, seg, len(keys) - 1), q, k, v)[1](
            ct.astype(dtype)) + (_attend(impl, blocks, q, k, v, seg, len(keys) - 1),))
        return [np.asarray(x, np.float32) for x in jax.tree.leaves(f(*cast((q, keys, values))))]

    ref = run("xla", jnp.float32)
    for impl in ("pallas", "xla"):
        errs = [(np.abs(x - y).max(), np.linalg.norm(x - y) / np.linalg.norm(y))
                for x, y in zip(run(impl, jnp.bfloat16), ref, strict=True)]
        print(f"bf16 {impl:>6} vs fp32 xla (dq, dk0..2, dv0..2, out): max abs "
              + " ".join(f"{a:.2e}" for a, _ in errs) + " | rel "
              + " ".join(f"{r:.1e}" for _, r in errs))


def _attend(impl, blocks, q, keys, values, seg, k):
    keys, values = keys[:k + 1], values[:k + 1]
    if impl == "pallas" or (impl == "pallas-cudnn0" and k > 0):
        return ttt._ttt_attend(q, keys, values, seg, impl="pallas", flash_blocks=blocks)
    if impl in ("main", "pallas-cudnn0") and k == 0:
        return attend(q, keys[0], values[0], causal_mask(seg), "cudnn" if GPU else "xla")
    return ttt._ttt_attend(q, keys, values, seg)


def time_all_steps(shape, impl, blocks, steps=7, reps=5) -> float:
    """ms of forward + backward of the K steps' attention (one q per step, as training)."""
    b, t, n, kh, h = shape
    q, keys, values, seg, ct = _inputs(b, t, n, kh, h, steps, jnp.bfloat16)

    def loss(q, keys, values):
        return sum(jnp.vdot(_attend(impl, blocks, q * (1 + k), keys, values, seg, k)
                            .astype(jnp.float32), ct.astype(jnp.float32))
                   for k in range(steps))

    f = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
    jax.block_until_ready(f(q, keys, values))
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(f(q, keys, values))
        times.append(time.perf_counter() - t0)
    return float(np.median(times)) * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--blocks", nargs="*", default=["64,64,64,64,4,2"],
                   help="tile settings q,k,bwd_q,bwd_k,num_warps,num_stages")
    p.add_argument("--shapes", default=",".join(SHAPES))
    p.add_argument("--no-check", action="store_true")
    args = p.parse_args()
    settings = [flash.FlashBlocks(*map(int, s.split(",")), interpret=not GPU)
                for s in args.blocks]
    print(f"device: {jax.devices()[0].device_kind}, jax {jax.__version__}")
    if not args.no_check:
        try:
            check(settings[0])
        except Exception as e:  # report and go on to the timings
            print(f"check failed: {type(e).__name__}: {str(e)[-1500:]}")
    for name in args.shapes.split(","):
        shape = SHAPES[name]
        print(f"{name}: main (cuDNN step 0 + XLA blocks) {time_all_steps(shape, 'main', None):.1f} ms")
        for blocks, impl in [(b, "pallas") for b in settings] + [(settings[0], "pallas-cudnn0")]:
            tiles = (f"{blocks.q},{blocks.k},{blocks.bwd_q},{blocks.bwd_k},w{blocks.num_warps},"
                     f"s{blocks.num_stages}")
            try:
                print(f"{name}: {impl} {tiles} {time_all_steps(shape, impl, blocks):.1f} ms")
            except Exception as e:  # a tile setting Triton cannot compile: report, go on
                print(f"{name}: {impl} {tiles} failed: {str(e).splitlines()[0][:160]}")


if __name__ == "__main__":
    main()
