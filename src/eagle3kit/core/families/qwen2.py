"""Qwen2 (Qwen2, Qwen2.5, Qwen2.5-Coder): a Llama layer with biases on q, k and v, whatever
config.json's `attention_bias` says (Qwen2's configs do not carry it)."""

from typing import Any

MODEL_TYPES = {"qwen2": "Qwen2ForCausalLM"}

GGUF_ARCH = "qwen2"


def fields(d: dict[str, Any], num_layers: int, source: object) -> dict[str, Any]:
    return {"attention_bias": True}
