"""Qwen3 (dense): a Llama layer with a per-head RMSNorm on q and k."""

from typing import Any

MODEL_TYPES = {"qwen3": "Qwen3ForCausalLM"}

GGUF_ARCH = "qwen3"


def fields(d: dict[str, Any], num_layers: int, source: object) -> dict[str, Any]:
    return {"qk_norm": True}
