"""Generated tokens/s of the batched engine (`regenerate`'s), next to transformers' own batched
`generate` of the same model and prompts, on the same device in the same process.

Every prompt is answered with exactly --new tokens (no stop token), so both sides do the same
work; the engine is timed after a warm-up pass that compiles its programs. The bandwidth bound
is what a decode step cannot beat on this card: it must read every weight once and each live
row's keys and values, so tokens/s <= rows / ((weight bytes + KV bytes) / bandwidth).

    # SmolLM2 on real ShareGPT first turns (its chat template), several slot counts
    python benchmarks/generate_speed.py --target SmolLM2-135M-Instruct.Q4_1.gguf \\
        --sharegpt ShareGPT_V3_unfiltered_cleaned_split.json --prompts 1024 --slots 128,256,512
    # the Llama-3.1-8B shape with random weights, random 256-token prompts
    python benchmarks/generate_speed.py --random-target benchmarks/configs/llama-3.1-8b-instruct.json \\
        --prompts 512 --prompt-len 256 --slots 64,128,256
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from eagle3kit.core.config import TargetConfig
from eagle3kit.core.sharding import init_weights, make_mesh
from eagle3kit.core.target import TargetWeights
from eagle3kit.decode.engine import Engine, EngineConfig, Request
from eagle3kit.io.hf import load_target, resolve_target

BANDWIDTH = {"NVIDIA H200": 4.8e12, "NVIDIA H100 80GB HBM3": 3.35e12}


def sharegpt_prompts(path: str, tokenizer, n: int, max_len: int) -> list[list[int]]:
    from eagle3kit.data.chat import prompt_ids
    from eagle3kit.data.sources import Reader, drop_reason, normalise, parse_source
    from eagle3kit.decode.conversations import plan

    out = []
    for raw in Reader(parse_source(path)):
        try:
            rec = normalise(raw, "sharegpt", "sharegpt")
        except Exception:
            continue
        kept, at = plan(rec.messages, first_only=True)
        if drop_reason(rec) is not None or not at:
            continue
        try:
            ids = prompt_ids(tokenizer, kept[: at[0]])
        except Exception:
            continue
        if len(ids) <= max_len:
            out.append(ids)
            if len(out) == n:
                break
    return out


def engine_run(tcfg, w, mesh, prompts, slots, new, max_context) -> tuple[float, int]:
    engine = Engine(tcfg, w, mesh, [], EngineConfig(rows=slots, max_context=max_context,
                                                    sync_every=32))
    requests = [Request(i, p, new) for i, p in enumerate(prompts)]
    engine.generate(requests[: slots * 3 // 2])  # compile the shapes (refills too)
    t0 = time.perf_counter()
    out = engine.generate(requests)
    seconds = time.perf_counter() - t0
    assert all(len(c.tokens) == new for c in out)
    return seconds, engine.cache_bytes


def hf_run(model, prompts, batch, new) -> float:
    """transformers' batched greedy generate, left-padded batches of `batch` prompts."""
    import torch

    t0 = time.perf_counter()
    for i in range(0, len(prompts), batch):
        chunk = prompts[i: i + batch]
        width = max(len(p) for p in chunk)
        ids = torch.zeros((len(chunk), width), dtype=torch.long)
        mask = torch.zeros_like(ids)
        for j, p in enumerate(chunk):
            ids[j, width - len(p):] = torch.tensor(p)
            mask[j, width - len(p):] = 1
        with torch.no_grad():
            model.generate(ids.cuda(), attention_mask=mask.cuda(), max_new_tokens=new,
                           min_new_tokens=new, do_sample=False, pad_token_id=0,
                           eos_token_id=None)
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", help="HF directory or .gguf (real weights)")
    ap.add_argument("--random-target", help="HF config.json: random bf16 weights of its shape")
    ap.add_argument("--sharegpt", help="ShareGPT JSON: first-turn prompts (with --target)")
    ap.add_argument("--prompts", type=int, default=512)
    ap.add_argument("--prompt-len", type=int, default=256, help="random prompts' length")
    ap.add_argument("--new", type=int, default=256)
    ap.add_argument("--slots", default="64,128,256")
    ap.add_argument("--hf-batch", type=int, default=0, help="also time transformers' "
                    "generate at this batch size (0: skip)")
    ap.add_argument("--hf-prompts", type=int, default=0, help="prompts for transformers "
                    "(default: all)")
    args = ap.parse_args()

    mesh = make_mesh("data=1,tensor=1", jax.devices()[:1])
    rng = np.random.default_rng(0)
    if args.random_target:
        hf_cfg = json.loads(Path(args.random_target).read_text())
        tcfg = TargetConfig.from_hf_config(hf_cfg)
        w = init_weights(TargetWeights.abstract(tcfg, jnp.bfloat16), jax.random.key(1))
        prompts = [list(map(int, rng.integers(0, tcfg.vocab_size, args.prompt_len)))
                   for _ in range(args.prompts)]
        source = f"random {args.prompt_len}-token prompts"
    else:
        from eagle3kit.data.tokenizer import load_tokenizer

        ckpt = resolve_target(args.target)
        tcfg, hf_cfg = ckpt.config, ckpt.hf_config
        w = load_target(ckpt, mesh, jnp.bfloat16)
        prompts = sharegpt_prompts(args.sharegpt, load_tokenizer(args.target), args.prompts,
                                   1024)
        source = f"{len(prompts)} real ShareGPT first turns"
    lens = [len(p) for p in prompts]
    device = jax.devices()[0].device_kind
    weight_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(w))
    print(f"# {tcfg.name or args.random_target} on {device}, jax {jax.__version__}; {source}, "
          f"mean prompt {np.mean(lens):.0f} tokens, {args.new} new tokens each, bf16")
    print("| generator | batch | tokens/s | share of bandwidth bound | seconds |")
    print("|---|---|---|---|---|")
    total = args.new * len(prompts)
    bw = BANDWIDTH.get(device)
    kv_per_token = 2 * tcfg.num_layers * tcfg.num_kv_heads * tcfg.head_dim * 2
    for slots in map(int, args.slots.split(",")):
        max_context = -(-(max(lens) + args.new) // 128) * 128
        seconds, _ = engine_run(tcfg, w, mesh, prompts, slots, args.new, max_context)
        rate = total / seconds
        share = "n/a"
        if bw:  # a step reads the weights once and every live row's keys (mean context)
            step_bytes = weight_bytes + slots * kv_per_token * (np.mean(lens) + args.new / 2)
            share = f"{rate / (slots * bw / step_bytes):.0%}"
        print(f"| eagle3kit engine | {slots} | {rate:,.0f} | {share} | {seconds:.1f} |",
              flush=True)
    if args.hf_batch:
        import torch
        import transformers

        del w
        if args.random_target:
            cfg = transformers.AutoConfig.for_model(**hf_cfg)
            with torch.device("cuda"):
                model = transformers.AutoModelForCausalLM.from_config(cfg,
                                                                      dtype=torch.bfloat16)
        else:
            path = Path(args.target)
            model = transformers.AutoModelForCausalLM.from_pretrained(
                path.parent, gguf_file=path.name, dtype=torch.bfloat16).cuda()
        model.eval()
        hf_prompts = prompts[: args.hf_prompts or len(prompts)]
        hf_run(model, hf_prompts[: args.hf_batch], args.hf_batch, 8)  # warm-up
        seconds = hf_run(model, hf_prompts, args.hf_batch, args.new)
        print(f"| transformers generate | {args.hf_batch} | "
              f"{args.new * len(hf_prompts) / seconds:,.0f} | | {seconds:.1f} |", flush=True)


if __name__ == "__main__":
    main()
