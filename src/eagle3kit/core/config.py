"""Typed, frozen configurations of the target model and the EAGLE3 draft head.

Built from a Hugging Face `config.json` (`TargetConfig.from_hf_config`) and from each other
(`DraftConfig.for_target`). Variants are made with `dataclasses.replace`.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np

from eagle3kit.core import arches, families
from eagle3kit.errors import InputError

_ROPE_KINDS = ("default", "llama3", "linear", "yarn")


@dataclasses.dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding: plain, Llama-3 or linear frequency scaling, or YaRN (gpt-oss)."""

    theta: float = 10000.0
    kind: str = "default"  # "default" | "llama3" | "linear" | "yarn"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    beta_fast: float = 32.0  # yarn
    beta_slow: float = 1.0
    truncate: bool = True

    @classmethod
    def from_hf(cls, d: dict[str, Any], source: object = "config.json") -> RopeConfig:
        """Reads rope fields from a HF config (transformers 4.x `rope_theta`/`rope_scaling`
        or 5.x `rope_parameters`)."""
        params = dict(d.get("rope_parameters") or {})
        scaling = dict(d.get("rope_scaling") or {})
        merged = {**scaling, **params}
        theta = d.get("rope_theta", merged.get("rope_theta", 10000.0))
        kind = merged.get("rope_type", merged.get("type", "default")) or "default"
        if kind not in _ROPE_KINDS:
            raise InputError(f"unsupported rope scaling type {kind!r} (supported: "
                             + ", ".join(_ROPE_KINDS[1:]) + ")", path=source)
        if kind == "yarn" and any(merged.get(f) for f in ("attention_factor", "mscale",
                                                           "mscale_all_dim")):
            raise InputError("yarn rope with attention_factor/mscale is not supported",
                             path=source)
        return cls(
            theta=float(theta),
            kind=kind,
            factor=float(merged.get("factor", 1.0)),
            low_freq_factor=float(merged.get("low_freq_factor", 1.0)),
            high_freq_factor=float(merged.get("high_freq_factor", 4.0)),
            original_max_position_embeddings=int(
                merged.get("original_max_position_embeddings", 8192)),
            beta_fast=float(merged.get("beta_fast") or 32.0),
            beta_slow=float(merged.get("beta_slow") or 1.0),
            truncate=bool(merged.get("truncate", True)),
        )

    def to_hf(self) -> dict[str, Any]:
        """The `rope_theta` and `rope_scaling` fields as engines read them."""
        out: dict[str, Any] = {"rope_theta": self.theta}
        if self.kind == "llama3":
            out["rope_scaling"] = {
                "rope_type": "llama3", "factor": self.factor,
                "low_freq_factor": self.low_freq_factor,
                "high_freq_factor": self.high_freq_factor,
                "original_max_position_embeddings": self.original_max_position_embeddings,
            }
        elif self.kind == "linear":
            out["rope_scaling"] = {"rope_type": "linear", "factor": self.factor}
        elif self.kind == "yarn":
            out["rope_scaling"] = {
                "rope_type": "yarn", "factor": self.factor, "beta_fast": self.beta_fast,
                "beta_slow": self.beta_slow, "truncate": self.truncate,
                "original_max_position_embeddings": self.original_max_position_embeddings,
            }
        else:
            out["rope_scaling"] = None
        return out

    def inv_freq(self, head_dim: int) -> np.ndarray:
        """Inverse frequencies [head_dim // 2], float32, exactly as transformers computes them."""
        inv = 1.0 / (self.theta ** (np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32)
                                    / head_dim))
        if self.kind == "linear":
            inv = inv / self.factor
        elif self.kind == "llama3":
            old = self.original_max_position_embeddings
            low_wavelen = old / self.low_freq_factor
            high_wavelen = old / self.high_freq_factor
            wavelen = 2 * math.pi / inv
            scaled = np.where(wavelen > low_wavelen, inv / self.factor, inv)
            smooth = (old / wavelen - self.low_freq_factor) / (
                self.high_freq_factor - self.low_freq_factor)
            smoothed = (1 - smooth) * scaled / self.factor + smooth * scaled
            medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
            inv = np.where(medium, smoothed, scaled)
        elif self.kind == "yarn":
            inv = self._yarn(head_dim, inv)
        return inv.astype(np.float32)

    def _yarn(self, head_dim: int, inv: np.ndarray) -> np.ndarray:
        """YaRN: extrapolated high frequencies, interpolated low ones, a linear ramp between
        (the correction range in dimensions, as transformers' `_compute_yarn_parameters`)."""
        def correction_dim(rotations):
            return (head_dim * math.log(self.original_max_position_embeddings
                                        / (rotations * 2 * math.pi))) / (2 * math.log(self.theta))
        low, high = correction_dim(self.beta_fast), correction_dim(self.beta_slow)
        if self.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, head_dim - 1)
        if low == high:
            high += 0.001
        ramp = np.clip((np.arange(head_dim // 2, dtype=np.float32) - low) / (high - low), 0, 1)
        extrapolation = 1 - ramp
        return (inv / self.factor) * (1 - extrapolation) + inv * extrapolation

    @property
    def attention_scaling(self) -> float:
        """Factor on cos and sin (YaRN's 0.1 ln(factor) + 1; 1 otherwise)."""
        if self.kind == "yarn" and self.factor > 1:
            return 0.1 * math.log(self.factor) + 1.0
        return 1.0


@dataclasses.dataclass(frozen=True)
class MoeConfig:
    """Routed experts (Qwen3-MoE, gpt-oss): each token goes through `top_k` of `num_experts`
    SwiGLU experts of width `expert_size`, weighted by its router probabilities."""

    num_experts: int
    top_k: int
    expert_size: int
    # per layer: True where the MLP is routed experts, False where it is dense
    sparse_layers: tuple[bool, ...]
    # "softmax_topk": softmax over all experts, then top-k (renormalised if `norm_topk_prob`);
    # "topk_softmax": top-k of the logits, softmax over those k (gpt-oss)
    routing: str = "softmax_topk"
    norm_topk_prob: bool = True
    bias: bool = False  # router and expert biases (gpt-oss)
    # gpt-oss's clamped SwiGLU: (clip(up, -limit, limit) + 1) * g * sigmoid(alpha * g) with
    # g = min(gate, limit); 0 = plain SwiGLU
    swiglu_limit: float = 0.0
    swiglu_alpha: float = 1.702

    @property
    def num_sparse(self) -> int:
        return sum(self.sparse_layers)


@dataclasses.dataclass(frozen=True)
class TargetConfig:
    """A decoder-only target: Llama (incl. Llama-3 rope), Qwen2, Qwen3, Qwen3-MoE, gpt-oss or
    Gemma-3 (text). The family-specific fields below keep the Llama defaults."""

    family: str  # a registered family's name (core/families)
    vocab_size: int
    hidden_size: int
    intermediate_size: int  # dense MLP width (gpt-oss: the expert width)
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope: RopeConfig = RopeConfig()
    max_position_embeddings: int = 8192
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # q/k/v biases (Qwen2, gpt-oss)
    qk_norm: bool = False  # per-head RMSNorm on q and k (Qwen3, Gemma-3)
    model_type: str = "llama"
    architectures: tuple[str, ...] = ()
    name: str = ""  # Hub id or local path, for fingerprints and model cards
    # ---- per-layer attention: windows (0 = full) and which rope each layer uses
    layer_windows: tuple[int, ...] = ()  # empty: every layer attends to its whole context
    local_rope: RopeConfig | None = None  # rope of the windowed layers when it differs (Gemma-3)
    attention_sinks: bool = False  # a learned per-head logit in each softmax (gpt-oss)
    query_scale: float = 0.0  # scores scale; 0 = head_dim ** -0.5 (Gemma-3: query_pre_attn_scalar)
    attn_softcap: float = 0.0  # tanh soft cap on attention scores; 0 = none
    # ---- Gemma-3: (1 + w) RMSNorm, sqrt(D)-scaled embeddings, norms after attention and MLP
    gemma_norms: bool = False
    mlp_activation: str = "silu"  # "silu" | "gelu_tanh"
    moe: MoeConfig | None = None

    @classmethod
    def from_hf_config(cls, d: dict[str, Any], *, name: str = "",
                       source: object = "config.json") -> TargetConfig:
        """Builds the config from a parsed HF `config.json`; unknown families are an error."""
        model_type = d.get("model_type", "")
        known = families.registry.model_types()
        if model_type not in known:
            raise InputError(
                f"unsupported architecture model_type={model_type!r} "
                f"(architectures={d.get('architectures')}); supported: "
                + ", ".join(f"{t} ({known[t][1]})" for t in sorted(known)),
                path=source)
        family = known[model_type][0]
        try:
            hidden, heads = int(d["hidden_size"]), int(d["num_attention_heads"])
            num_layers = int(d["num_hidden_layers"])
            base = dict(
                family=family.name,
                vocab_size=int(d["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(d["intermediate_size"]),
                num_layers=num_layers,
                num_heads=heads,
                num_kv_heads=int(d.get("num_key_value_heads") or heads),
                head_dim=int(d.get("head_dim") or hidden // heads),
                rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
                rope=RopeConfig.from_hf(d, source),
                max_position_embeddings=int(d.get("max_position_embeddings", 8192)),
                tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
                attention_bias=bool(d.get("attention_bias", False)),
                model_type=model_type,
                architectures=tuple(d.get("architectures") or ()),
                name=name or str(d.get("_name_or_path", "")),
            )
            _check_quantisation(d, family.quantisations, source)
            base.update(family.fields(d, num_layers, source))
            return cls(**base)
        except KeyError as e:
            raise InputError(f"config is missing the field {e.args[0]!r}", path=source) from None

    def rope_for_layer(self) -> tuple[RopeConfig, ...]:
        """The distinct ropes, index 0 the global one (`layer_rope_index` points into it)."""
        return (self.rope,) if self.local_rope is None else (self.rope, self.local_rope)

    def layer_rope_index(self) -> tuple[int, ...]:
        if self.local_rope is None or not self.layer_windows:
            return (0,) * self.num_layers
        return tuple(int(w > 0) for w in self.layer_windows)

    def default_aux_layer_ids(self) -> tuple[int, int, int]:
        """HF `hidden_states` indices captured by default: inputs of layers 2, N//2, N-3."""
        n = self.num_layers
        return (2, n // 2, n - 3)

    @property
    def num_params(self) -> int:
        d, f, n = self.hidden_size, self.intermediate_size, self.num_layers
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        per_layer = d * (q + 2 * kv) + q * d + 2 * d
        mlp = n * 3 * d * f
        if self.moe is not None:
            m = self.moe
            sparse = m.num_experts * (3 * d * m.expert_size) + d * m.num_experts
            mlp = (n - m.num_sparse) * 3 * d * f + m.num_sparse * sparse
        head = 0 if self.tie_word_embeddings else self.vocab_size * d
        return self.vocab_size * d + n * per_layer + mlp + d + head

    @property
    def active_params(self) -> int:
        """Parameters one token passes through (routed experts count top_k of num_experts)."""
        if self.moe is None:
            return self.num_params
        m = self.moe
        idle = m.num_sparse * (m.num_experts - m.top_k) * 3 * self.hidden_size * m.expert_size
        return self.num_params - idle


def _check_quantisation(d: dict[str, Any], known: tuple[str, ...], source: object) -> None:
    """`quantization_config.quant_method` must be one the family understands (`known`)."""
    q = d.get("quantization_config")
    if not q:
        return
    method = q.get("quant_method") if isinstance(q, dict) else q
    if method not in known:
        raise InputError(f"quantization_config.quant_method={method!r} is not understood for "
                         f"{d.get('model_type')} (understood: {', '.join(known) or 'none'}; "
                         "use the unquantised bf16 checkpoint)", path=source)


def layer_windows(d: dict[str, Any], n: int, source: object, default_window: int = 0
                  ) -> tuple[int, ...]:
    """Per-layer sliding windows from `layer_types` (or Gemma's `sliding_window_pattern`)."""
    window = int(d.get("sliding_window") or default_window)
    types = d.get("layer_types")
    if types is None and d.get("sliding_window_pattern"):
        p = int(d["sliding_window_pattern"])
        types = ["full_attention" if (i + 1) % p == 0 else "sliding_attention" for i in range(n)]
    if not types:
        return ()
    if len(types) != n or set(types) - {"sliding_attention", "full_attention"}:
        raise InputError(f"layer_types must list {n} of sliding_attention/full_attention; "
                         f"found {types}", path=source)
    if "sliding_attention" in types and window < 1:
        raise InputError("layer_types has sliding_attention layers but sliding_window is "
                         f"{d.get('sliding_window')!r}", path=source)
    return tuple(window if t == "sliding_attention" else 0 for t in types)




@dataclasses.dataclass(frozen=True)
class DraftConfig:
    """The EAGLE3 draft head: one Llama decoder layer whose attention reads 2H."""

    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int  # target vocab V (for t2d)
    draft_vocab_size: int  # Vd
    target_hidden_size: int  # fc reads 3 * target_hidden_size
    aux_layer_ids: tuple[int, ...]  # HF hidden_states indices of the target
    rms_norm_eps: float = 1e-6
    rope: RopeConfig = RopeConfig()
    max_position_embeddings: int = 8192
    # False (EAGLE3, SGLang, SpecForge): the residual is the un-normed fused state g.
    norm_before_residual: bool = False
    # EAGLE-3.1: an RMSNorm per captured state before fc, and the post-norm hidden carried to
    # the next step (core/draft.py); both False is EAGLE3.
    fc_norm: bool = False
    norm_output: bool = False
    # The method the architecture is built on (core/arches.py): "eagle3" is core/draft.py's
    # step, which the flags above vary. Parallel drafters propose `block_size` tokens in one
    # pass of `num_layers` decoder layers, the positions after the first reading the embedding
    # of `mask_token_id`. Written to a config only when not these defaults, so that the
    # configs of EAGLE-3 drafts stay as they were.
    method: str = "eagle3"
    num_layers: int = 1
    block_size: int = 0
    mask_token_id: int | None = None

    @property
    def arch(self) -> str:
        """The registered architecture (core/arches.py) of this draft: its method and flags
        (an imported draft with another mix of flags: the method, `+` and its flags)."""
        fields = arches.flag_fields()
        flags = {f: bool(getattr(self, f)) for f in fields}
        return next((a.name for a in arches.arches() if a.method == self.method
                     and flags == {f: f in a.flags for f in fields}),
                    "+".join([self.method, *(f for f, on in flags.items() if on)]))

    def with_arch(self, name: str) -> DraftConfig:
        """The same draft with the registered architecture `name`."""
        arch = arches.get(name)
        if arch is None:
            raise InputError(f"unknown draft architecture {name!r}; choose "
                             f"{', '.join(arches.names())}")
        return dataclasses.replace(self, method=arch.method,
                                   **{f: f in arch.flags for f in arches.flag_fields()})

    @classmethod
    def for_target(cls, target: TargetConfig, draft_vocab_size: int = 32000,
                   aux_layer_ids: tuple[int, ...] | None = None) -> DraftConfig:
        """The standard draft for `target`: same widths, heads, rope and context length."""
        ids = tuple(aux_layer_ids) if aux_layer_ids else target.default_aux_layer_ids()
        for i in ids:
            if not 0 <= i < target.num_layers:
                raise InputError(f"aux layer id {i} is outside 0..{target.num_layers - 1} "
                                 "(HF hidden_states indices: the input of that layer)")
        if draft_vocab_size > target.vocab_size:
            raise InputError(f"draft vocab {draft_vocab_size} > target vocab {target.vocab_size}")
        return cls(
            hidden_size=target.hidden_size,
            intermediate_size=target.intermediate_size,
            num_heads=target.num_heads,
            num_kv_heads=target.num_kv_heads,
            head_dim=target.head_dim,
            vocab_size=target.vocab_size,
            draft_vocab_size=draft_vocab_size,
            target_hidden_size=target.hidden_size,
            aux_layer_ids=ids,
            rms_norm_eps=target.rms_norm_eps,
            # A YaRN target (gpt-oss) gets a plain rope of the same base, as the published
            # gpt-oss drafts use: the draft head does not scale cos/sin by YaRN's mscale.
            rope=target.rope if target.rope.kind != "yarn" else RopeConfig(theta=target.rope.theta),
            max_position_embeddings=target.max_position_embeddings,
        )

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["aux_layer_ids"] = list(self.aux_layer_ids)
        for name, default in _OMITTED_AT_DEFAULT.items():
            if d[name] == default:
                del d[name]
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> DraftConfig:
        d = dict(d)
        d["rope"] = RopeConfig(**d["rope"])
        d["aux_layer_ids"] = tuple(d["aux_layer_ids"])
        return cls(**d)

    @property
    def num_params(self) -> int:
        own = getattr(arches.method_module(self.method), "num_params", None)
        if own is not None:  # a method with weights beyond EAGLE-3's
            return own(self)
        d, f = self.hidden_size, self.intermediate_size
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        a = len(self.aux_layer_ids) * self.target_hidden_size
        return (a * d + 2 * d * (q + 2 * kv) + q * d + 3 * d * f
                + 4 * d + self.draft_vocab_size * d + (a if self.fc_norm else 0))


_OMITTED_AT_DEFAULT = {"method": "eagle3", "num_layers": 1, "block_size": 0,
                       "mask_token_id": None}
