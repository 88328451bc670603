"""gpt-oss: sliding-window layers (128) alternating with full ones, a learned sink logit per
head in each softmax, an output bias, YaRN rope, and routed experts (top-k of biased router
logits, softmax over the k) with biases and a clamped SwiGLU. Its checkpoints ship the experts
in MXFP4 (io/mxfp4.py) and fused: gate and up interleaved in one `gate_up_proj`."""

from typing import Any

from eagle3kit.core.config import MoeConfig, layer_windows

MODEL_TYPES = {"gpt_oss": "GptOssForCausalLM"}
QUANTISATIONS = ("mxfp4",)

# fused 3-D expert parameters in (in, out) layout (MXFP4 `_blocks`/`_scales` pairs read as
# these names, see io/mxfp4.py); "even"/"odd": gate and up interleaved on the last axis
HF_KEYS = {
    "experts.router": ("model.layers.{i}.mlp.router.weight", "router"),
    "experts.router_bias": ("model.layers.{i}.mlp.router.bias", "same"),
    "experts.gate": ("model.layers.{i}.mlp.experts.gate_up_proj", "even"),
    "experts.up": ("model.layers.{i}.mlp.experts.gate_up_proj", "odd"),
    "experts.down": ("model.layers.{i}.mlp.experts.down_proj", "same"),
    "experts.gate_bias": ("model.layers.{i}.mlp.experts.gate_up_proj_bias", "even"),
    "experts.up_bias": ("model.layers.{i}.mlp.experts.gate_up_proj_bias", "odd"),
    "experts.down_bias": ("model.layers.{i}.mlp.experts.down_proj_bias", "same"),
}


def fields(d: dict[str, Any], n: int, source: object) -> dict[str, Any]:
    return {
        "layer_windows": layer_windows(d, n, source, default_window=128),
        "attention_sinks": True,
        "moe": MoeConfig(
            num_experts=int(d["num_local_experts"]), top_k=int(d["num_experts_per_tok"]),
            expert_size=int(d["intermediate_size"]), sparse_layers=(True,) * n,
            routing="topk_softmax", norm_topk_prob=False, bias=True,
            swiglu_limit=float(d.get("swiglu_limit", 7.0)),
            swiglu_alpha=float(d.get("swiglu_alpha", 1.702))),
    }
