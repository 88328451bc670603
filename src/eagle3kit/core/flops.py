"""Model FLOPs of a training step and MFU: the convention docs/benchmarks.md defines.

Per useful (non-padding) token of a row of length T, with P(.) the matmul parameters:

    target forward   2 * P(target layers + lm_head) + causal attention (P: the active
                     parameters of an MoE; a sliding-window layer's keys capped by its window)
    draft            K * (6 * P(one TTT step: q, k, v, o, MLP, lm_head) + attention)
                     + 6 * P(fc)   (the fusion of the captured states runs once)
    attention        forward 2 * 2 * (T / 2) * N * H per layer (q.k and p.v over the causal
                     half of T keys); the draft's x3 for its backward

Rematerialisation and the diagonal TTT keys are not counted, so MFU compares steps that
compute the same function however they schedule it. For the Llama-3.1-8B shape at T = 2048,
K = 7, Vd = 32,000 this is 31.9 GFLOP per token.
"""

from __future__ import annotations

from eagle3kit.core.config import DraftConfig, TargetConfig

# dense bf16 tensor-core peak (FLOP/s) by the start of `device_kind` (SXM parts); MFU is None
# on other devices
PEAK_BF16 = {"NVIDIA H200": 989e12, "NVIDIA H100": 989e12, "NVIDIA A100": 312e12}


def _attention(num_heads: int, head_dim: int, seq_len: int) -> float:
    """Forward FLOPs per token of one causal attention layer (q.k and p.v)."""
    return 2 * 2 * (seq_len / 2) * num_heads * head_dim


def target_matmul_params(tcfg: TargetConfig) -> int:
    """Matmul parameters a token passes through: an MoE layer counts its router and the
    top_k of its experts (the active parameters), not the idle experts."""
    d, f = tcfg.hidden_size, tcfg.intermediate_size
    q, kv = tcfg.num_heads * tcfg.head_dim, tcfg.num_kv_heads * tcfg.head_dim
    mlp = tcfg.num_layers * 3 * d * f
    if tcfg.moe is not None:
        m = tcfg.moe
        mlp = ((tcfg.num_layers - m.num_sparse) * 3 * d * f
               + m.num_sparse * (m.top_k * 3 * d * m.expert_size + d * m.num_experts))
    return tcfg.num_layers * (d * (q + 2 * kv) + q * d) + mlp + d * tcfg.vocab_size


def draft_step_matmul_params(dcfg: DraftConfig) -> int:
    """One TTT step: q, k, v from the 2D-wide input, o, the MLP and the lm head."""
    d, f = dcfg.hidden_size, dcfg.intermediate_size
    q, kv = dcfg.num_heads * dcfg.head_dim, dcfg.num_kv_heads * dcfg.head_dim
    return 2 * d * (q + 2 * kv) + q * d + 3 * d * f + d * dcfg.draft_vocab_size


def flops_per_token(tcfg: TargetConfig, dcfg: DraftConfig, seq_len: int, steps: int) -> float:
    """Model FLOPs of one training step per useful token (see the module docstring)."""
    # a sliding-window layer attends to at most its window (of the T / 2 keys on average)
    windows = tcfg.layer_windows or (0,) * tcfg.num_layers
    keys = sum(min(seq_len, 2 * w) if w else seq_len for w in windows)
    target = 2 * target_matmul_params(tcfg) + _attention(tcfg.num_heads, tcfg.head_dim, keys)
    fc = 6 * len(dcfg.aux_layer_ids) * dcfg.target_hidden_size * dcfg.hidden_size
    step = 6 * draft_step_matmul_params(dcfg) + 3 * _attention(dcfg.num_heads, dcfg.head_dim,
                                                               seq_len)
    return target + fc + steps * step


def peak_bf16(device_kind: str) -> float | None:
    """The device's dense bf16 peak (FLOP/s); None for an unknown device."""
    return next((v for k, v in PEAK_BF16.items() if device_kind.startswith(k)), None)


def mfu(flops_per_s: float, device_kind: str) -> float | None:
    """Model FLOP/s over the device's dense bf16 peak; None for an unknown device."""
    peak = peak_bf16(device_kind)
    return None if peak is None else flops_per_s / peak
