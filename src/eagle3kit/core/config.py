"""Typed, frozen configurations of the target model and the EAGLE3 draft head.

Built from a Hugging Face `config.json` (`TargetConfig.from_hf_config`) and from each other
(`DraftConfig.for_target`). Variants are made with `dataclasses.replace`.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np

from eagle3kit.errors import InputError

# model_type -> family. Mistral-style checkpoints are Llama without sliding windows.
_FAMILIES = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}


@dataclasses.dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding: plain, or Llama-3 frequency scaling (`rope_type: llama3`)."""

    theta: float = 10000.0
    kind: str = "default"  # "default" | "llama3" | "linear"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    @classmethod
    def from_hf(cls, d: dict[str, Any], source: object = "config.json") -> RopeConfig:
        """Reads rope fields from a HF config (transformers 4.x `rope_theta`/`rope_scaling`
        or 5.x `rope_parameters`)."""
        params = dict(d.get("rope_parameters") or {})
        scaling = dict(d.get("rope_scaling") or {})
        merged = {**scaling, **params}
        theta = d.get("rope_theta", merged.get("rope_theta", 10000.0))
        kind = merged.get("rope_type", merged.get("type", "default")) or "default"
        if kind not in ("default", "llama3", "linear"):
            raise InputError(f"unsupported rope scaling type {kind!r} (supported: llama3, linear)",
                             path=source)
        return cls(
            theta=float(theta),
            kind=kind,
            factor=float(merged.get("factor", 1.0)),
            low_freq_factor=float(merged.get("low_freq_factor", 1.0)),
            high_freq_factor=float(merged.get("high_freq_factor", 4.0)),
            original_max_position_embeddings=int(
                merged.get("original_max_position_embeddings", 8192)),
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
        return inv.astype(np.float32)


@dataclasses.dataclass(frozen=True)
class TargetConfig:
    """A decoder-only target model: Llama (incl. Llama-3 rope), Qwen2 or Qwen3."""

    family: str  # "llama" | "qwen2" | "qwen3"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope: RopeConfig = RopeConfig()
    max_position_embeddings: int = 8192
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # q/k/v biases (Qwen2)
    qk_norm: bool = False  # per-head RMSNorm on q and k (Qwen3)
    model_type: str = "llama"
    architectures: tuple[str, ...] = ()
    name: str = ""  # Hub id or local path, for fingerprints and model cards

    @classmethod
    def from_hf_config(cls, d: dict[str, Any], *, name: str = "",
                       source: object = "config.json") -> TargetConfig:
        """Builds the config from a parsed HF `config.json`; unknown families are an error."""
        model_type = d.get("model_type", "")
        if model_type not in _FAMILIES:
            raise InputError(
                f"unsupported architecture model_type={model_type!r} "
                f"(architectures={d.get('architectures')}); supported: "
                + ", ".join(sorted(_FAMILIES)), path=source)
        family = _FAMILIES[model_type]
        try:
            hidden, heads = int(d["hidden_size"]), int(d["num_attention_heads"])
            return cls(
                family=family,
                vocab_size=int(d["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(d["intermediate_size"]),
                num_layers=int(d["num_hidden_layers"]),
                num_heads=heads,
                num_kv_heads=int(d.get("num_key_value_heads") or heads),
                head_dim=int(d.get("head_dim") or hidden // heads),
                rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
                rope=RopeConfig.from_hf(d, source),
                max_position_embeddings=int(d.get("max_position_embeddings", 8192)),
                tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
                attention_bias=(family == "qwen2") or bool(d.get("attention_bias", False)),
                qk_norm=family == "qwen3",
                model_type=model_type,
                architectures=tuple(d.get("architectures") or ()),
                name=name or str(d.get("_name_or_path", "")),
            )
        except KeyError as e:
            raise InputError(f"config is missing the field {e.args[0]!r}", path=source) from None

    def default_aux_layer_ids(self) -> tuple[int, int, int]:
        """HF `hidden_states` indices captured by default: inputs of layers 2, N//2, N-3."""
        n = self.num_layers
        return (2, n // 2, n - 3)

    @property
    def num_params(self) -> int:
        d, f, n = self.hidden_size, self.intermediate_size, self.num_layers
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        per_layer = d * (q + 2 * kv) + q * d + 3 * d * f + 2 * d
        head = 0 if self.tie_word_embeddings else self.vocab_size * d
        return self.vocab_size * d + n * per_layer + d + head


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
            rope=target.rope,
            max_position_embeddings=target.max_position_embeddings,
        )

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["aux_layer_ids"] = list(self.aux_layer_ids)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> DraftConfig:
        d = dict(d)
        d["rope"] = RopeConfig(**d["rope"])
        d["aux_layer_ids"] = tuple(d["aux_layer_ids"])
        return cls(**d)

    @property
    def num_params(self) -> int:
        d, f = self.hidden_size, self.intermediate_size
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        return (3 * self.target_hidden_size * d + 2 * d * (q + 2 * kv) + q * d + 3 * d * f
                + 4 * d + self.draft_vocab_size * d)
