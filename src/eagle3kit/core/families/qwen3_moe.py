"""Qwen3-MoE: Qwen3's layer with routed experts (softmax over all experts, top-k,
renormalised when `norm_topk_prob`); the layers of `mlp_only_layers`, and those
`decoder_sparse_step` skips, keep a dense MLP. Its experts are one Linear each in the
checkpoint, stacked on load (io/hf's `experts.*` keys)."""

from typing import Any

from eagle3kit.core.config import MoeConfig
from eagle3kit.errors import InputError

MODEL_TYPES = {"qwen3_moe": "Qwen3MoeForCausalLM"}


def fields(d: dict[str, Any], n: int, source: object) -> dict[str, Any]:
    if d.get("use_sliding_window"):
        raise InputError("Qwen3-MoE with use_sliding_window=true is not supported", path=source)
    experts = int(d.get("num_experts") or d.get("num_local_experts") or 0)
    step = int(d.get("decoder_sparse_step", 1))
    dense = set(d.get("mlp_only_layers") or ())
    sparse = tuple(i not in dense and experts > 0 and (i + 1) % step == 0 for i in range(n))
    if not any(sparse):
        return {"qk_norm": True}
    return {"qk_norm": True, "moe": MoeConfig(
        num_experts=experts, top_k=int(d["num_experts_per_tok"]),
        expert_size=int(d["moe_intermediate_size"]), sparse_layers=sparse,
        routing="softmax_topk", norm_topk_prob=bool(d.get("norm_topk_prob", False)))}
