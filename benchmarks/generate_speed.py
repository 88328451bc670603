"""Generated tokens/s of the batched engine (`regenerate`'s), next to transformers' own batched
`generate` of the same model and prompts, on the same device in the same process.

Every prompt is answered with exactly --new tokens (no stop token), so both sides do the same
work; the engine is timed after a warm-up pass that compiles its programs. The bandwidth bound
is what a decode step cannot beat on this card: it must read every weight once (an untied
embedding table only at its rows' entries: `step_weight_bytes`) and each live row's keys and
values, so tokens/s <= rows / ((weight bytes + KV bytes) / bandwidth). The
roofline adds the time the prompts' prefill needs at the card's dense bf16 peak, run after
the decode steps as this engine's separate prefill programs run it (`bounds`): with
256-token prompts and 256 new tokens of the 8B shape at 128 rows it is 71% of the bandwidth
bound on an H200 (78% on an H100), the most such an engine can reach of that bound there. An
engine that mixes prompt chunks into its memory-bound decode steps (chunked prefill) could
hide the prefill's FLOPs under the steps' reads; docs/benchmarks.md, issue 22.

    # SmolLM2 on real ShareGPT first turns (its chat template), several slot counts
    python benchmarks/generate_speed.py --target SmolLM2-135M-Instruct.Q4_1.gguf \\
        --sharegpt ShareGPT_V3_unfiltered_cleaned_split.json --prompts 1024 --slots 128,256,512
    # the Llama-3.1-8B shape with random weights, random 256-token prompts
    python benchmarks/generate_speed.py --random-target benchmarks/configs/llama-3.1-8b-instruct.json \\
        --prompts 512 --prompt-len 256 --slots 64,128,256
    # four GPUs: one process, the rows over data=4 (`regenerate --mesh data=4`) ...
    python benchmarks/generate_speed.py ... --prompts 2048 --slots 512 --mesh data=4
    # ... or four processes of one GPU each, a quarter of the prompts each (`regenerate
    # --shard I/4`); they start timing together and the rate of all four is combined:
    for i in 0 1 2 3; do CUDA_VISIBLE_DEVICES=$i python benchmarks/generate_speed.py ... \\
        --prompts 2048 --slots 128 --shard $i/4 --together /tmp/gen > /tmp/gen/$i.json & done
    wait; python benchmarks/generate_speed.py --combine /tmp/gen/?.json
    # prompts riding in the decode steps (decode/mixed.py) against prefill programs apart,
    # both in one process: --mixed-budget 0 is before, 512 after
    python benchmarks/generate_speed.py ... --slots 128,512 --attention pallas --stagger \
        --mixed-budget 0,512
    # where a decode step's time goes: after the timed pass, one more pass of --slots
    # prompts is traced and summed by named scope (benchmarks/profile_summary.py)
    python benchmarks/generate_speed.py ... --slots 128 --profile /tmp/prof
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
from eagle3kit.core.flops import peak_bf16, target_matmul_params
from eagle3kit.core.sharding import init_weights, make_mesh
from eagle3kit.core.target import TargetWeights, unstack_in_place
from eagle3kit.decode.engine import Engine, EngineConfig, Request
from eagle3kit.decode.sampling import Sampling
from eagle3kit.io.hf import load_target, resolve_target

BANDWIDTH = {"NVIDIA H200": 4.8e12, "NVIDIA H100 80GB HBM3": 3.35e12}


def bounds(tcfg, weight_bytes: float, lens: list[int], new: int, slots: int, data: int = 1,
           tensor: int = 1, bandwidth: float = 0.0, peak_flops: float = 0.0
           ) -> tuple[float, float]:
    """(bandwidth bound, roofline) in generated tokens/s of answering every prompt of `lens`
    with `new` tokens at `slots` rows. The bandwidth bound counts decode steps alone: each
    reads every weight once and each live row's keys and values (mean context); `data`
    devices do that at once, each for slots / data rows, and `tensor` devices split a step's
    bytes. The roofline adds the prefill's matmul and attention FLOPs at the dense peak, run
    apart from the decode steps (this engine's prefill programs): with long prompts such an
    engine reaches the roofline at best, not the bandwidth bound."""
    kv_per_token = 2 * tcfg.num_layers * tcfg.num_kv_heads * tcfg.head_dim * 2  # bf16
    step_bytes = (weight_bytes + slots / data * kv_per_token * (np.mean(lens) + new / 2)) / tensor
    total = new * len(lens)
    decode_s = total / slots * step_bytes / bandwidth
    # a prompt token passes every layer's matmuls (the lm head only for the last one) and
    # attends to the causal half of its prompt
    layer_params = target_matmul_params(tcfg) - tcfg.hidden_size * tcfg.vocab_size
    attn = 2 * 2 * tcfg.num_heads * tcfg.head_dim * tcfg.num_layers
    prefill_flops = sum(n * (2 * layer_params + attn * n / 2) for n in lens)
    prefill_s = prefill_flops / (peak_flops * data * tensor)
    return total / decode_s, total / (decode_s + prefill_s)


def step_weight_bytes(w: TargetWeights) -> int:
    """The weight bytes a decode step reads: all of them but an untied embedding table, of
    which a step reads only its rows' entries (a tied one is read whole as the lm head)."""
    total = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(w))
    return total - (w.embed.size * w.embed.dtype.itemsize if w.lm_head is not None else 0)


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


def engine_run(tcfg, w, mesh, prompts, slots, new, max_context, together=None,
               attention="xla", sampling=Sampling(), profile=None, check_every=1,
               mixed_budget=0, news=None) -> tuple[float, float, str | None]:
    """(seconds, wall-clock start, profile) of generating `new` tokens for every prompt,
    after a warm-up pass; with `together` (a shard), timing starts once every shard is warm.
    With `profile` (a directory), one more pass of `slots` prompts is traced: where its
    time went (else None)."""
    engine = Engine(tcfg, w, mesh, [], EngineConfig(rows=slots, max_context=max_context,
                                                    sync_every=32, attention=attention,
                                                    sampling=sampling,
                                                    check_every=check_every,
                                                    mixed_budget=mixed_budget))
    news = news or [new] * len(prompts)  # (--stagger: answers of different lengths)
    requests = [Request(i, p, n) for i, (p, n) in enumerate(zip(prompts, news, strict=True))]
    engine.generate(requests[: slots * 3 // 2])  # compile the shapes (refills too)
    if together:
        together()
    start, t0 = time.time(), time.perf_counter()
    out = engine.generate(requests)
    seconds = time.perf_counter() - t0
    assert [len(c.tokens) for c in out] == news
    summary = None
    if profile:
        import profile_summary

        summary = profile_summary.profile_engine(engine, requests[:slots],
                                                 Path(profile) / f"trace-{slots}",
                                                 Path(profile) / "hlo")
    return seconds, start, summary


def barrier(directory: str, name: str, index: int, count: int, timeout: float = 900.0):
    """Returns a function that waits until `count` processes have called it (files
    `name.I` in `directory`), so the shards' timed passes overlap."""
    def wait() -> None:
        Path(directory).mkdir(parents=True, exist_ok=True)
        Path(directory, f"{name}.{index}").touch()
        t0 = time.monotonic()
        while len(list(Path(directory).glob(f"{name}.*"))) < count:
            if time.monotonic() - t0 > timeout:
                raise SystemExit(f"shard {index}: the other shards did not get ready")
            time.sleep(0.05)
    return wait


def combine(paths: list[str]) -> None:
    """The shards' rate: all their tokens over the span from the first start to the last end
    (one line per shard: what `--shard` prints)."""
    shards = [json.loads(Path(p).read_text().strip().splitlines()[-1]) for p in paths]
    start = min(s["start"] for s in shards)
    end = max(s["start"] + s["seconds"] for s in shards)
    tokens = sum(s["tokens"] for s in shards)
    each = ", ".join(f"{s['tokens'] / s['seconds']:,.0f}" for s in shards)
    print(f"| eagle3kit engine, {len(shards)} processes (--shard) | {shards[0]['slots']} each | "
          f"{tokens / (end - start):,.0f} | per process: {each} | | {end - start:.1f} |")


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
    ap.add_argument("--attention", default="xla", choices=("xla", "pallas"),
                    help="how decode steps read the KV cache (EngineConfig.attention)")
    ap.add_argument("--check-every", type=int, default=1, help="device steps between a "
                    "decode program's checks whether to end early (EngineConfig.check_every, "
                    "a divisor of 32)")
    ap.add_argument("--mixed-budget", default="0", help="prompt tokens each decode step "
                    "carries (EngineConfig.mixed_budget, decode/mixed.py; 0: prefill programs "
                    "apart); a comma list times each, e.g. 0,512: before and after")
    ap.add_argument("--stagger", action="store_true", help="answers of --new/2 to --new "
                    "tokens (fixed per prompt), so rows finish apart and refills find rows "
                    "decoding (what --mixed-budget rides on; with equal answers every refill "
                    "comes when all rows are done)")
    ap.add_argument("--hf-batch", type=int, default=0, help="also time transformers' "
                    "generate at this batch size (0: skip)")
    ap.add_argument("--hf-prompts", type=int, default=0, help="prompts for transformers "
                    "(default: all)")
    ap.add_argument("--mesh", default=None, help="e.g. data=4: the engine's rows over the "
                    "devices of one process, --slots in all (default: one device)")
    ap.add_argument("--shard", default=None, help="I/N: time only the I-th block of the "
                    "prompts and print one JSON line (run N processes, then --combine)")
    ap.add_argument("--together", default=None, help="--shard: a directory where the N "
                    "processes wait for each other before timing")
    ap.add_argument("--combine", nargs="+", default=None, help="the JSON lines of the N "
                    "--shard processes: print their combined rate")
    ap.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--profile", default=None, help="a directory: after each timed pass, "
                    "trace one pass of --slots prompts and print where its time goes")
    args = ap.parse_args()
    if args.combine:
        return combine(args.combine)
    if args.profile:
        import profile_summary

        profile_summary.dump_engine_hlo(args.profile)

    mesh = make_mesh(args.mesh) if args.mesh else make_mesh("data=1,tensor=1",
                                                             jax.devices()[:1])
    rng = np.random.default_rng(0)
    if args.random_target:
        hf_cfg = json.loads(Path(args.random_target).read_text())
        tcfg = TargetConfig.from_hf_config(hf_cfg)
        w = init_weights(TargetWeights.abstract(tcfg, jnp.bfloat16), jax.random.key(1), mesh)
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
        if len(prompts) < args.prompts:  # a small carried file: its prompts again, in order
            prompts = [prompts[i % len(prompts)] for i in range(args.prompts)]
            source = f"{args.prompts} prompts of {source}"
    if args.shard:
        index, count = map(int, args.shard.split("/"))
        per = -(-len(prompts) // count)
        prompts = prompts[index * per: (index + 1) * per]
        source += f", shard {args.shard}: {len(prompts)} of them"
    lens = [len(p) for p in prompts]
    device = jax.devices()[0].device_kind
    weight_bytes = step_weight_bytes(w)
    w = unstack_in_place(w, tcfg)  # as `regenerate` runs it
    print(f"# {tcfg.name or args.random_target} on {jax.device_count()} x {device} (mesh "
          f"{dict(mesh.shape)}), jax {jax.__version__}; {source}, mean prompt "
          f"{np.mean(lens):.0f} tokens, {args.new} new tokens each"
          + (" (--stagger: down to half)" if args.stagger else "") + ", bf16; cache attention "
          f"{args.attention}" + (f"; temperature {args.temperature:g}, top-p {args.top_p:g}"
                                 if args.temperature else ", greedy")
          + (f"; checks every {args.check_every} steps" if args.check_every > 1 else "")
          + ("; profiled: no CUDA graphs" if args.profile else ""), flush=True)
    print("| generator | batch | tokens/s | share of bandwidth bound | share of roofline "
          "| seconds |")
    print("|---|---|---|---|---|---|")
    news = [args.new - (i * 97) % (args.new // 2) for i in range(len(prompts))] \
        if args.stagger else None
    total = sum(news) if news else args.new * len(prompts)
    bw = BANDWIDTH.get(device)
    peak = peak_bf16(device)
    data, tensor = mesh.shape["data"], mesh.shape["tensor"]
    runs = [(slots, int(m)) for slots in map(int, args.slots.split(","))
            for m in args.mixed_budget.split(",")]
    for slots, mixed in runs:
        max_context = -(-(max(lens) + args.new) // 128) * 128
        together = (barrier(args.together, f"slots{slots}m{mixed}", index, count)
                    if args.shard and args.together else None)
        seconds, start, summary = engine_run(tcfg, w, mesh, prompts, slots, args.new, max_context,
                                    together, args.attention,
                                    Sampling(args.temperature, args.top_p), args.profile,
                                    args.check_every, mixed, news)
        if args.shard:
            print(json.dumps({"shard": args.shard, "slots": slots, "mixed_budget": mixed,
                              "tokens": total, "seconds": seconds, "start": start}),
                  flush=True)
            continue
        rate = total / seconds
        share = roof = "n/a"
        if bw and peak:
            bound, roofline = bounds(tcfg, weight_bytes, lens, total / len(prompts), slots,
                                     data, tensor, bw, peak)
            share, roof = f"{rate / bound:.0%}", f"{rate / roofline:.0%}"
        where = f" ({args.mesh})" if args.mesh else ""
        where += f" (mixed {mixed})" if mixed else ""
        print(f"| eagle3kit engine{where} | {slots} | {rate:,.0f} | {share} | {roof} "
              f"| {seconds:.1f} |", flush=True)
        if summary:
            print(f"\nprofile, {slots} slots: one more pass of {slots} prompts, traced\n"
                  f"```\n{summary}\n```\n", flush=True)
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
              f"{args.new * len(hf_prompts) / seconds:,.0f} | | | {seconds:.1f} |", flush=True)


if __name__ == "__main__":
    main()
