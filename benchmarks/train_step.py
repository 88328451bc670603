"""Throughput of one TTT training step: tokens/s, step time, achieved FLOP/s, peak memory.

    python benchmarks/train_step.py --target SmolLM2-135M-Instruct.Q4_1.gguf \
        --seq-len 2048 --batch-size 4,8 --grad-accum 2 --attention xla,cudnn
    python benchmarks/train_step.py --random-target benchmarks/configs/llama-3.1-8b-instruct.json \
        --batch-size 4   # memory and speed of an 8B target without its weights
    python benchmarks/train_step.py --random-target benchmarks/configs/qwen3-30b-a3b.json \
        --batch-size 2,4   # an MoE target (also gpt-oss-20b.json, gemma-3-27b-it.json)

Packed rows of random documents (64..2048 tokens) with real segment structure; the step is the
same jitted function `eagle3kit train` runs. TFLOP/s divides the
step's model FLOPs (`model_flops`: 2P per token for the frozen target, 6P per token and TTT
step for the draft, plus attention; rematerialisation not counted), so "TFLOP/s" compares with
the device's peak as MFU does.
"""

from __future__ import annotations

import argparse
import itertools
import json
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from eagle3kit.core import ttt
from eagle3kit.core.config import DraftConfig, TargetConfig
from eagle3kit.core.layers import resolve_attention
from eagle3kit.core.optim import OptimConfig
from eagle3kit.core.sharding import init_weights, make_mesh
from eagle3kit.core.target import TargetWeights
from eagle3kit.core.trainer import Trainer, put_batch
from eagle3kit.core.vocab import VocabMap
from eagle3kit.io.hf import load_target, resolve_target


def packed_rows(rng, rows: int, seq_len: int, vocab: int) -> dict[str, np.ndarray]:
    out = {k: np.zeros((rows, seq_len), np.int32) for k in
           ("tokens", "loss_mask", "segment_ids", "positions")}
    for r in range(rows):
        t, seg = 0, 1
        while t < seq_len - 64:
            n = int(min(rng.integers(64, 2048), seq_len - t))
            out["tokens"][r, t:t + n] = rng.integers(0, vocab, n)
            out["loss_mask"][r, t + n // 3:t + n] = 1  # the last two thirds: "assistant"
            out["segment_ids"][r, t:t + n] = seg
            out["positions"][r, t:t + n] = np.arange(n)
            t, seg = t + n, seg + 1
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--target", help="a target checkpoint (directory, .gguf or Hub id)")
    src.add_argument("--random-target", help="a HF config.json: random bf16 weights of that "
                     "shape (e.g. benchmarks/configs/llama-3.1-8b-instruct.json)")
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--batch-size", default="4", help="comma-separated values to sweep")
    p.add_argument("--grad-accum", type=int, default=1)
    p.add_argument("--ttt-length", type=int, default=7)
    p.add_argument("--draft-vocab", type=int, default=32000)
    p.add_argument("--attention", default="auto", help="comma-separated: auto,xla,cudnn")
    p.add_argument("--mesh", default=None)
    p.add_argument("--steps", type=int, default=5)
    args = p.parse_args()

    mesh = make_mesh(args.mesh)
    if args.target:
        ckpt = resolve_target(args.target)
        tcfg = ckpt.config
        target_w = load_target(ckpt, mesh, jnp.bfloat16)
    else:
        tcfg = TargetConfig.from_hf_config(json.loads(Path(args.random_target).read_text()))
        target_w = init_weights(TargetWeights.abstract(tcfg, jnp.bfloat16), jax.random.key(1),
                                mesh)
    dcfg = DraftConfig.for_target(tcfg, args.draft_vocab)
    vocab = VocabMap.from_ids(np.arange(args.draft_vocab), tcfg.vocab_size)
    rng = np.random.default_rng(0)
    dev = jax.devices()[0]
    print(f"device: {jax.device_count()} x {dev.device_kind}; target {tcfg.name} "
          f"({tcfg.num_params / 1e6:.0f}M params, {tcfg.active_params / 1e6:.0f}M active), draft {dcfg.num_params / 1e6:.1f}M, "
          f"K={args.ttt_length}, T={args.seq_len}, accum={args.grad_accum}")
    print(f"{'batch':>5} {'attn':>6} {'compile s':>9} {'step ms':>8} {'tokens/s':>10} "
          f"{'TFLOP/s':>8} {'peak GiB':>8}")
    for batch, attn in itertools.product([int(b) for b in args.batch_size.split(",")],
                                         args.attention.split(",")):
        impl = resolve_attention(attn, jnp.bfloat16)
        trainer = Trainer(tcfg, dcfg, ttt.TTTConfig(args.ttt_length, 0.8, jnp.bfloat16, impl),
                          OptimConfig(total_steps=100), mesh)
        va = jax.device_put(ttt.VocabArrays.from_map(vocab), trainer.replicated)
        state = trainer.init_state(jax.random.key(0))
        arrays = packed_rows(rng, batch * args.grad_accum, args.seq_len, tcfg.vocab_size)
        arrays = {k: v.reshape(args.grad_accum, batch, args.seq_len) for k, v in arrays.items()}
        tokens = int((arrays["segment_ids"] > 0).sum())
        try:
            t0 = time.perf_counter()
            state, m = trainer.train_step(state, target_w, va, put_batch(trainer, arrays))
            jax.block_until_ready(m.loss)
            compile_s = time.perf_counter() - t0
            flops = model_flops(tcfg, dcfg, tokens, args.seq_len, args.ttt_length)
            times = []
            for _ in range(args.steps):
                t0 = time.perf_counter()
                state, m = trainer.train_step(state, target_w, va, put_batch(trainer, arrays))
                jax.block_until_ready(m.loss)
                times.append(time.perf_counter() - t0)
        except Exception as e:  # OOM at a large batch: report and continue the sweep
            print(f"{batch:>5} {impl:>6}  failed: {str(e).splitlines()[0][:90]}")
            continue
        step = float(np.median(times))
        # peak since the process started (the sweep's earlier rows included)
        peak = (dev.memory_stats() or {}).get("peak_bytes_in_use", 0) / 2**30
        tflops = f"{flops / step / 1e12:8.1f}"
        print(f"{batch:>5} {impl:>6} {compile_s:9.1f} {step * 1e3:8.1f} {tokens / step:10,.0f} "
              f"{tflops} {peak:8.1f}")


def model_flops(tcfg, dcfg, tokens: int, seq_len: int, steps: int) -> float:
    """Model FLOPs of one step (the MFU convention: rematerialisation not counted).

    Target forward 2*P per token (P: the active parameters of an MoE) plus causal attention; draft forward+backward 6*P per token
    and TTT step plus its attention (the step-0 keys; the diagonal keys are negligible).
    Attention spans T/2 keys on average (an upper bound for packed, shorter documents).
    """
    def attn(cfg, keys):  # q.k and p.v, forward, per token, summed over layers
        return 2 * 2 * keys * cfg.num_heads * cfg.head_dim
    windows = tcfg.layer_windows or (0,) * tcfg.num_layers  # a sliding window caps the keys
    target_keys = sum(min(seq_len / 2, w) if w else seq_len / 2 for w in windows)
    target = 2 * tcfg.active_params + attn(tcfg, target_keys)
    draft = 6 * dcfg.num_params + 3 * attn(dcfg, seq_len / 2)
    return tokens * (target + steps * draft)


if __name__ == "__main__":
    main()
