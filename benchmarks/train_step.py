"""Throughput of one TTT training step: tokens/s, model TFLOP/s, MFU, peak memory.

    python benchmarks/train_step.py --target SmolLM2-135M-Instruct.Q4_1.gguf \
        --seq-len 2048 --batch-size 4,8 --grad-accum 2 --attention xla,cudnn
    python benchmarks/train_step.py --random-target benchmarks/configs/llama-3.1-8b-instruct.json \
        --batch-size 2 --profile /tmp/prof   # + where the device time goes, by named scope
    python benchmarks/train_step.py --random-target benchmarks/configs/qwen3-30b-a3b.json \
        --batch-size 2,4   # an MoE target (also gpt-oss-20b.json, gemma-3-27b-it.json)

Packed rows of random documents (64..2048 tokens, `--full-rows`: one document per row) with
real segment structure; the step is the same jitted function `eagle3kit train` runs. Model
FLOPs and MFU follow `eagle3kit.core.flops` (the convention of docs/benchmarks.md).

"step ms" waits for each step before sending the next (the batch's transfer and the
dispatch are in it); "piped" is `eagle3kit train`'s loop: the next batch is sent while a step
runs and the step is dispatched once the last one ended (one step in flight, so Ctrl-C or
SIGTERM stops at the boundary after it), so only the dispatch is not overlapped with the
device's work. Tokens/s, TFLOP/s and MFU are the step's; "piped tok/s" is the trainer's rate.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import os
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from eagle3kit.core import flops as model_flops
from eagle3kit.core import ttt
from eagle3kit.core.config import DraftConfig, TargetConfig
from eagle3kit.core.flash import FlashBlocks
from eagle3kit.core.optim import OptimConfig
from eagle3kit.core.sharding import ArrayInfo, init_weights, is_info, make_mesh
from eagle3kit.core.target import TargetWeights
from eagle3kit.core.trainer import Trainer, put_batch
from eagle3kit.core.vocab import VocabMap
from eagle3kit.io.hf import load_target, resolve_target

try:  # where they live now; an older src tree (gpu_session.sh speed's BEFORE) has them elsewhere
    from eagle3kit.core.train_attention import resolve_attention
    from eagle3kit.core.vocab_arrays import VocabArrays
except ImportError:
    from eagle3kit.core.layers import resolve_attention as _resolve_before
    from eagle3kit.core.ttt import VocabArrays

    def resolve_attention(impl, backend, dtype, draft_dtype=None):
        return _resolve_before(impl, dtype, draft_dtype)


def packed_rows(rng, rows: int, seq_len: int, vocab: int, full: bool = False
                ) -> dict[str, np.ndarray]:
    out = {k: np.zeros((rows, seq_len), np.int32) for k in
           ("tokens", "loss_mask", "segment_ids", "positions")}
    for r in range(rows):
        t, seg = 0, 1
        while t < seq_len - 64:
            n = seq_len if full else int(min(rng.integers(64, 2048), seq_len - t))
            out["tokens"][r, t:t + n] = rng.integers(0, vocab, n)
            out["loss_mask"][r, t + n // 3:t + n] = 1  # the last two thirds: "assistant"
            out["segment_ids"][r, t:t + n] = seg
            out["positions"][r, t:t + n] = np.arange(n)
            t, seg = t + n, seg + 1
    return out


def per_layer(stack) -> list:
    """One `ArrayInfo` tree per layer of a stacked one (for `target.layer_list`)."""
    def one(info: ArrayInfo) -> ArrayInfo:
        return dataclasses.replace(info, shape=info.shape[1:], axes=info.axes[1:])
    n = jax.tree.leaves(stack, is_leaf=is_info)[0].shape[0]
    return [jax.tree.map(one, stack, is_leaf=is_info)] * n


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
    p.add_argument("--attention", default="auto", help="comma-separated: auto,xla,cudnn,pallas")
    p.add_argument("--mesh", default=None)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--full-rows", action="store_true", help="one document filling each row")
    p.add_argument("--stacked", action="store_true", help="scan the target's stacked layers "
                   "(before the trainer unstacked them)")
    p.add_argument("--memory", action="store_true", help="print XLA's memory analysis of "
                   "the compiled step (arguments, outputs, temporaries per device)")
    p.add_argument("--remat", action="store_true", help="recompute each TTT step's forward")
    p.add_argument("--loss", default="kl", help="comma-separated `train --loss` names to sweep, "
                   "e.g. kl,tv,nla,lk-hybrid (the step's cost per loss)")
    p.add_argument("--position-weights", default="geometric", help="geometric or verify")
    p.add_argument("--attention-block", type=int, default=None,
                   help="query rows per block of the TTT attention")
    p.add_argument("--flash-blocks", default=None, help="tiles of the fused TTT attention "
                   "(--attention pallas): q,k,bwd_q,bwd_k,num_warps,num_stages")
    p.add_argument("--profile", default=None, help="trace 2 more steps into this directory "
                   "and print the device time by named scope")
    args = p.parse_args()
    if args.profile:  # read when the backend starts: the optimized HLO names every kernel;
        # CUDA graphs (command buffers) would show as one opaque kernel, so none are built
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + f" --xla_dump_to="
                                   f"{args.profile}/hlo --xla_dump_hlo_as_text "
                                   "--xla_dump_hlo_module_re=.*train_step.* "
                                   "--xla_gpu_enable_command_buffer=").strip()

    mesh = make_mesh(args.mesh)
    if args.target:
        ckpt = resolve_target(args.target)
        tcfg = ckpt.config
        target_w = load_target(ckpt, mesh, jnp.bfloat16)
    else:
        tcfg = TargetConfig.from_hf_config(json.loads(Path(args.random_target).read_text()))
        abstract = TargetWeights.abstract(tcfg, jnp.bfloat16)
        if not args.stacked:  # made per layer, never stacked: splitting a stack needs the
            # target plus its largest stack at once (75 GiB for Qwen3-30B-A3B's experts)
            from eagle3kit.core.target import layer_list
            abstract = layer_list(abstract, tcfg, per_layer)
        target_w = init_weights(abstract, jax.random.key(1), mesh)
    if not args.stacked:  # as `eagle3kit train` runs it (older checkouts have no unstacking)
        from eagle3kit.core.target import unstack_in_place
        target_w = unstack_in_place(target_w, tcfg, fuse=False)
    dcfg = DraftConfig.for_target(tcfg, args.draft_vocab)
    vocab = VocabMap.from_ids(np.arange(args.draft_vocab), tcfg.vocab_size)
    rng = np.random.default_rng(0)
    dev = jax.devices()[0]
    print(f"device: {jax.device_count()} x {dev.device_kind}; target {tcfg.name} "
          f"({tcfg.num_params / 1e6:.0f}M params, {tcfg.active_params / 1e6:.0f}M active), draft {dcfg.num_params / 1e6:.1f}M, "
          f"K={args.ttt_length}, T={args.seq_len}, accum={args.grad_accum}")
    print(f"{'batch':>5} {'attn':>6} {'compile s':>9} {'step ms':>8} {'tokens/s':>10} "
          f"{'TFLOP/s':>8} {'MFU':>5} {'peak GiB':>8} {'piped ms':>8} {'piped tok/s':>11}")
    for batch, attn, loss in itertools.product([int(b) for b in args.batch_size.split(",")],
                                               args.attention.split(","),
                                               args.loss.split(",")):
        impl = resolve_attention(attn, jax.default_backend(), jnp.bfloat16, jnp.bfloat16)
        extra = {} if args.attention_block is None else {"attention_block": args.attention_block}
        if args.flash_blocks:
            extra["flash_blocks"] = FlashBlocks(*map(int, args.flash_blocks.split(",")))
        if args.remat:  # only passed when asked: older checkouts (before/after runs) lack it
            extra["remat"] = True
        if loss != "kl" or args.position_weights != "geometric":  # likewise
            extra.update(loss=loss, position_weights=args.position_weights)
            print(f"loss {loss}, position weights {args.position_weights}:")
        trainer = Trainer(tcfg, dcfg, ttt.TTTConfig(args.ttt_length, 0.8, jnp.bfloat16, impl,
                                                    **extra),
                          OptimConfig(total_steps=100), mesh)
        va = jax.device_put(VocabArrays.from_map(vocab), trainer.replicated)
        state = trainer.init_state(jax.random.key(0))
        arrays = packed_rows(rng, batch * args.grad_accum, args.seq_len, tcfg.vocab_size,
                             args.full_rows)
        arrays = {k: v.reshape(args.grad_accum, batch, args.seq_len) for k, v in arrays.items()}
        tokens = int((arrays["segment_ids"] > 0).sum())
        try:  # every step at step 0's LR (an input of the step: its cost is the same)
            t0 = time.perf_counter()
            state, m = trainer.train_step(state, target_w, va, put_batch(trainer, arrays), 0)
            jax.block_until_ready(m.loss)
            compile_s = time.perf_counter() - t0
            flops = tokens * model_flops.flops_per_token(tcfg, dcfg, args.seq_len,
                                                         args.ttt_length)
            times = []
            for _ in range(args.steps):
                t0 = time.perf_counter()
                state, m = trainer.train_step(state, target_w, va, put_batch(trainer, arrays), 0)
                jax.block_until_ready(m.loss)
                times.append(time.perf_counter() - t0)
            t0, previous = time.perf_counter(), None
            for _ in range(args.steps):  # the trainer's loop: one step in flight
                batch_dev = put_batch(trainer, arrays)  # while the last step runs
                if previous is not None:
                    jax.block_until_ready(previous.loss)
                state, m = trainer.train_step(state, target_w, va, batch_dev, 0)
                previous = m
            jax.block_until_ready(previous.loss)
            piped = (time.perf_counter() - t0) / args.steps
        except Exception as e:  # OOM at a large batch: report and continue the sweep
            print(f"{batch:>5} {impl:>6}  failed: {str(e).splitlines()[0][:90]}")
            continue
        step = float(np.median(times))
        # the busiest device's peak since the process started (the sweep's earlier rows
        # included); MFU per device of the mesh
        peak = max((d.memory_stats() or {}).get("peak_bytes_in_use", 0)
                   for d in mesh.devices.flat) / 2**30
        mfu = model_flops.mfu(flops / step / mesh.size, dev.device_kind)
        if args.memory:  # XLA's own accounting of the compiled step, per device
            from eagle3kit.core.sharding import use_mesh
            with use_mesh(mesh):
                batch_arrays = put_batch(trainer, arrays)
                mem = trainer._jitted["step"].lower(state, target_w, va, batch_arrays,
                                                      trainer.lr(0)).compile() \
                    .memory_analysis()
            print(f"      XLA per device: arguments {mem.argument_size_in_bytes / 2**30:.2f} "
                  f"GiB, outputs {mem.output_size_in_bytes / 2**30:.2f}, temporaries "
                  f"{mem.temp_size_in_bytes / 2**30:.2f}, aliased "
                  f"{mem.alias_size_in_bytes / 2**30:.2f}; per device now: " + ", ".join(
                      f"{(d.memory_stats() or {}).get('bytes_in_use', 0) / 2**30:.1f}"
                      for d in mesh.devices.flat) + " GiB in use")
        print(f"{batch:>5} {impl:>6} {compile_s:9.1f} {step * 1e3:8.1f} {tokens / step:10,.0f} "
              f"{flops / step / 1e12:8.1f} {'-' if mfu is None else f'{mfu:.1%}':>5} "
              f"{peak:8.1f} {piped * 1e3:8.1f} {tokens / piped:11,.0f}")
        if args.profile:
            import profile_summary
            trace = Path(args.profile) / f"trace-b{batch}-{impl}"
            jax.profiler.start_trace(str(trace))
            for _ in range(2):
                state, m = trainer.train_step(state, target_w, va, put_batch(trainer, arrays), 0)
                jax.block_until_ready(m.loss)
            jax.profiler.stop_trace()
            print(profile_summary.summarize(trace, Path(args.profile) / "hlo", 2))


if __name__ == "__main__":
    main()
