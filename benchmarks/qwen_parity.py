"""A Qwen2 GGUF target (issue 35: the 1.5B on the GPU host) against transformers' own
Qwen2ForCausalLM reading the same file, fp32: tests/core/test_qwen2_real.py's checks, which
`make test-qwen` runs on the 0.5B on two CPUs, for a model too large for that suite.

    python benchmarks/qwen_parity.py MODEL.gguf [--prompts 3] [--new-tokens 24] [--out R.md]

1. the config eagle3kit reads is the one transformers builds from the header;
2. every tensor as loaded equals the `gguf` package's dequantisation and transformers' (and,
   for Q8_0/Q4_K/Q6_K, transformers' own torch dequantisation) bit for bit;
3. two real ShareGPT conversations (256 tokens each, the file's template) as one batch: every
   position's final normed state and captured layer inputs, and the last 16 positions'
   logits, within the 0.5B test's tolerance (tests/core/test_target.py's RTOL);
4. `eagle3kit regenerate` (CLI, fp32, greedy) answers each prompt with the tokens and text
   transformers' `generate` gives.

Prints a markdown table; exits 1 on any mismatch. The checks are the tests' own helpers
(tests/core/gguf_reference.py), imported from this checkout. JAX's fp32 matmuls run at full
precision (no TF32 on a GPU); transformers runs on the CPU, as in the tests.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

os.environ.setdefault("JAX_DEFAULT_MATMUL_PRECISION", "highest")  # before jax: fp32 is fp32
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # regenerate shares the GPU
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import torch  # noqa: E402
from tests import assets  # noqa: E402
from tests.core.gguf_reference import (  # noqa: E402
    assert_config_is_transformers,
    chat_stop_ids,
    check_every_tensor,
    check_forward,
    sharegpt_rows,
)

from eagle3kit.core.sharding import make_mesh  # noqa: E402
from eagle3kit.data.tokenizer import load_tokenizer  # noqa: E402
from eagle3kit.io.hf import load_target, resolve_target  # noqa: E402

T, LAST = 256, 16  # as tests/core/test_qwen2_real.py
QUESTIONS = ("What is the capital of France?",
             "Write a Python function that returns the square of a number.",
             "Explain in two sentences what a hash table is.")


def _check(rows: list, name: str, fn) -> None:
    t = time.perf_counter()
    try:
        detail = fn() or ""
        rows.append((name, "ok", detail, time.perf_counter() - t))
    except Exception as e:  # noqa: BLE001 - one row per check, the rest still run
        traceback.print_exc()
        rows.append((name, "**FAIL**", str(e).splitlines()[0][:200] if str(e) else
                     type(e).__name__, time.perf_counter() - t))


def _forward(gguf: Path, ckpt, weights, model) -> str:
    n = ckpt.config.num_layers
    aux = (2, n // 2, n - 3)  # the default captured layers
    tokens = sharegpt_rows(load_tokenizer(str(gguf)), 2, T)
    check_forward(weights, ckpt.config, model, tokens, aux, LAST)
    return f"2 x {T} tokens, layers {aux}"


def _regenerate(gguf: Path, model, questions, new_tokens: int) -> str:
    with tempfile.TemporaryDirectory() as tmp:
        chats, out = Path(tmp) / "chats.jsonl", Path(tmp) / "out.jsonl"
        chats.write_text("".join(json.dumps({"id": f"q{i}", "messages": [
            {"role": "user", "content": q}, {"role": "assistant", "content": "-"}]}) + "\n"
            for i, q in enumerate(questions)))
        r = subprocess.run([sys.executable, "-m", "eagle3kit", "regenerate", "--target",
                            str(gguf), "-i", str(chats), "-o", str(out), "--max-new-tokens",
                            str(new_tokens), "--max-context", "256", "--slots",
                            str(len(questions)), "--target-dtype", "float32", "--mesh",
                            "data=1,tensor=1"], capture_output=True, text=True,
                           env={**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)})
        if r.returncode:
            raise AssertionError(f"regenerate exited {r.returncode}: {r.stderr[-300:]}")
        got = {rec["id"]: rec for rec in map(json.loads, out.read_text().splitlines())}
    tok = assets.transformers_gguf_tokenizer(gguf)
    for i, q in enumerate(questions):
        prompt = list(tok.apply_chat_template([{"role": "user", "content": q}],
                                              add_generation_prompt=True, tokenize=True,
                                              return_dict=True)["input_ids"])
        with torch.no_grad():
            ids = model.generate(torch.tensor([prompt]), max_new_tokens=new_tokens,
                                 do_sample=False, eos_token_id=chat_stop_ids(tok))
        new = ids[0, len(prompt):].tolist()
        rec = got[f"q{i}"]
        (turn,) = rec["generation"]["turns"]
        answer = tok.decode(new, skip_special_tokens=True)
        assert turn["prompt_tokens"] == len(prompt), (q, turn, len(prompt))
        assert rec["messages"][-1] == {"role": "assistant", "content": answer}, (
            q, rec["messages"][-1]["content"], answer)
        assert turn["new_tokens"] == len(new), (q, turn, len(new))
        print(f"  {q!r} -> {answer[:80]!r}", flush=True)
    return f"{len(questions)} prompts x {new_tokens} tokens, token for token"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("gguf", type=Path)
    ap.add_argument("--prompts", type=int, default=3, help="greedy prompts (1-3)")
    ap.add_argument("--new-tokens", type=int, default=24)
    ap.add_argument("--out", type=Path, help="also write the markdown table here")
    args = ap.parse_args()
    torch.set_num_threads(os.cpu_count() or 1)

    t = time.perf_counter()
    ckpt = resolve_target(args.gguf)
    mesh = make_mesh("data=1,tensor=1", jax.devices()[:1])
    weights = load_target(ckpt, mesh, jnp.float32)
    loaded = time.perf_counter() - t
    t = time.perf_counter()
    model = assets.torch_from_gguf(args.gguf)
    loaded_ref = time.perf_counter() - t
    cfg = ckpt.config

    rows: list = []
    _check(rows, "config = transformers' reading",
           lambda: assert_config_is_transformers(ckpt, model))

    def tensors():
        seen = check_every_tensor(ckpt, model)
        assert sum(seen.values()) == len(model.state_dict()), seen
        return ", ".join(f"{k} {v}" for k, v in sorted(seen.items()))

    _check(rows, "every tensor dequantised equal", tensors)
    _check(rows, "normed states, aux states, logits (fp32)",
           lambda: _forward(args.gguf, ckpt, weights, model))
    weights = None  # regenerate loads the target again, in its own process
    _check(rows, "greedy regenerate = transformers generate",
           lambda: _regenerate(args.gguf, model, QUESTIONS[:args.prompts], args.new_tokens))

    lines = [f"### {args.gguf.name}: eagle3kit vs transformers {_version()} (fp32)", "",
             f"{cfg.family}, {cfg.num_layers} layers, hidden {cfg.hidden_size}, heads "
             f"{cfg.num_heads}/{cfg.num_kv_heads}, vocab {cfg.vocab_size}; "
             f"{jax.devices()[0].device_kind}; load {loaded:.0f} s (eagle3kit), "
             f"{loaded_ref:.0f} s (transformers)", "",
             "| check | result | detail | s |", "|---|---|---|---|"]
    lines += [f"| {n} | {r} | {d} | {s:.0f} |" for n, r, d, s in rows]
    text = "\n".join(lines)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    return 1 if any(r != "ok" for _, r, _, _ in rows) else 0


def _version() -> str:
    import transformers

    return transformers.__version__


if __name__ == "__main__":
    sys.exit(main())
