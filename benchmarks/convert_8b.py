"""Time and memory of `convert` for a draft the size of a Llama-3.1-8B head (~0.4B parameters).

Builds a draft for the Llama-3.1-8B-Instruct config (hidden 4096, 32 layers, vocab 128256,
draft vocab 32000; random fp32 weights, a random vocab map), saves it in eagle3kit's format,
then times each conversion the CLI runs (`load_any_draft` + `export_draft`): eagle3kit ->
sglang (bf16), eagle3kit -> speculators (bf16), sglang -> eagle3kit, and checks that the
second bf16 trip is byte-identical. Reports seconds, output sizes and the process's peak RSS.

    python benchmarks/convert_8b.py --out /tmp/convert-bench
"""

from __future__ import annotations

import argparse
import platform
import resource
import shutil
import time
from pathlib import Path

import numpy as np

from eagle3kit.core.config import DraftConfig, TargetConfig
from eagle3kit.core.draft import DraftWeights
from eagle3kit.core.draft import arrays as draft_arrays
from eagle3kit.core.vocab import VocabMap
from eagle3kit.formats import export_draft, load_any_draft
from eagle3kit.io.draft_io import Draft, save_draft

LLAMA_31_8B = {
    "model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 128256,
    "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
    "num_attention_heads": 32, "num_key_value_heads": 8, "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0, "max_position_embeddings": 131072, "tie_word_embeddings": False,
    "bos_token_id": 128000, "eos_token_id": [128001, 128008, 128009],
    "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
}
NAME = "meta-llama/Llama-3.1-8B-Instruct"


def make_draft(seed: int = 0) -> Draft:
    cfg = DraftConfig.for_target(TargetConfig.from_hf_config(LLAMA_31_8B, name=NAME), 32000)
    rng = np.random.default_rng(seed)
    abstract = DraftWeights.abstract(cfg)
    w = {}
    for name, info in draft_arrays(abstract).items():
        shape = info.shape
        w[name] = (rng.standard_normal(shape, np.float32) * 0.02 if len(shape) > 1
                   else np.ones(shape, np.float32))
    vocab = VocabMap.from_ids(rng.choice(cfg.vocab_size, cfg.draft_vocab_size, replace=False),
                              cfg.vocab_size)
    return Draft(cfg, DraftWeights(**w), vocab, NAME, LLAMA_31_8B, {}, {"epochs": 3})


def timed(label: str, fn):
    t = time.perf_counter()
    out = fn()
    dt = time.perf_counter() - t
    size = sum(p.stat().st_size for p in Path(out).iterdir()) if out else 0
    print(f"{label:<34} {dt:7.2f} s   {size / 1e9:6.2f} GB")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("/tmp/eagle3kit-convert-bench"))
    args = ap.parse_args()
    shutil.rmtree(args.out, ignore_errors=True)
    print(f"{platform.processor() or platform.machine()}, {platform.python_version()}")
    d = make_draft()
    print(f"draft: {d.config.num_params / 1e6:.1f}M parameters (fp32 master)")
    own = timed("save eagle3kit (fp32)", lambda: save_draft(args.out / "own", d))
    timed("eagle3kit -> sglang (bf16)", lambda: export_draft(
        load_any_draft(own), "sglang", args.out / "sglang"))
    timed("eagle3kit -> speculators (bf16)", lambda: export_draft(
        load_any_draft(own), "speculators", args.out / "vllm"))
    back = timed("sglang -> eagle3kit (fp32)", lambda: export_draft(
        load_any_draft(args.out / "sglang"), "eagle3kit", args.out / "back"))
    timed("eagle3kit -> sglang again (bf16)", lambda: export_draft(
        load_any_draft(back), "sglang", args.out / "sglang2"))
    same = ((args.out / "sglang" / "model.safetensors").read_bytes()
            == (args.out / "sglang2" / "model.safetensors").read_bytes())
    print(f"second bf16 trip byte-identical: {same}")
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6  # KiB on Linux -> GB
    print(f"peak RSS: {peak:.2f} GB")
    shutil.rmtree(args.out, ignore_errors=True)


if __name__ == "__main__":
    main()
