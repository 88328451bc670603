"""GGUF checkpoints: config from the header, tensors dequantised to float32 with HF names.

Uses the `gguf` package only (no torch). Llama-family Q and K projections are stored by
llama.cpp with the rotary halves interleaved; they are permuted back to the HF layout here,
as transformers does, so a GGUF and a safetensors copy of one model give the same weights.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import numpy as np

from eagle3kit.errors import InputError

# GGUF architecture -> HF model_type
_ARCHS = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}

# GGUF tensor name -> HF tensor name
_NAMES = [
    (r"token_embd\.weight", "model.embed_tokens.weight"),
    (r"output_norm\.weight", "model.norm.weight"),
    (r"output\.weight", "lm_head.weight"),
    (r"blk\.(\d+)\.attn_norm\.weight", r"model.layers.\1.input_layernorm.weight"),
    (r"blk\.(\d+)\.ffn_norm\.weight", r"model.layers.\1.post_attention_layernorm.weight"),
    (r"blk\.(\d+)\.attn_q\.(weight|bias)", r"model.layers.\1.self_attn.q_proj.\2"),
    (r"blk\.(\d+)\.attn_k\.(weight|bias)", r"model.layers.\1.self_attn.k_proj.\2"),
    (r"blk\.(\d+)\.attn_v\.(weight|bias)", r"model.layers.\1.self_attn.v_proj.\2"),
    (r"blk\.(\d+)\.attn_output\.weight", r"model.layers.\1.self_attn.o_proj.weight"),
    (r"blk\.(\d+)\.attn_q_norm\.weight", r"model.layers.\1.self_attn.q_norm.weight"),
    (r"blk\.(\d+)\.attn_k_norm\.weight", r"model.layers.\1.self_attn.k_norm.weight"),
    (r"blk\.(\d+)\.ffn_gate\.weight", r"model.layers.\1.mlp.gate_proj.weight"),
    (r"blk\.(\d+)\.ffn_up\.weight", r"model.layers.\1.mlp.up_proj.weight"),
    (r"blk\.(\d+)\.ffn_down\.weight", r"model.layers.\1.mlp.down_proj.weight"),
]


def _hf_name(name: str) -> str | None:
    for pattern, repl in _NAMES:
        if re.fullmatch(pattern, name):
            return re.sub(pattern, repl, name)
    return None


def _field(reader, key: str, default: Any = None) -> Any:
    f = reader.fields.get(key)
    if f is None:
        return default
    value = f.contents()
    return value


class GGUFCheckpoint:
    """A GGUF model file: `config` (HF-style dict) and `get(hf_name)` -> float32 ndarray."""

    def __init__(self, path: str | os.PathLike):
        from gguf import GGUFReader

        self.path = Path(path)
        if not self.path.is_file():
            raise InputError("no such GGUF file", path=self.path)
        try:
            self.reader = GGUFReader(self.path)
        except Exception as e:  # gguf raises ValueError/struct errors on a bad file
            raise InputError(f"not a readable GGUF file ({e})", path=self.path) from None
        arch = _field(self.reader, "general.architecture")
        if arch not in _ARCHS:
            raise InputError(f"unsupported GGUF architecture {arch!r}; supported: "
                             + ", ".join(_ARCHS), path=self.path)
        self.arch = arch
        self._tensors = {}
        for t in self.reader.tensors:
            hf = _hf_name(t.name)
            if hf is None:
                if t.name == "rope_freqs.weight":
                    raise InputError("GGUF with baked rope_freqs (Llama-3.1 rope scaling) is not "
                                     "supported; load the HF safetensors checkpoint instead",
                                     path=self.path)
                raise InputError(f"unexpected tensor {t.name!r}", path=self.path)
            self._tensors[hf] = t
        self.config = self._config()

    def _config(self) -> dict[str, Any]:
        a = self.arch

        def get(key, default=None):
            return _field(self.reader, f"{a}.{key}", default)

        hidden, heads = int(get("embedding_length")), int(get("attention.head_count"))
        embed = self._tensors["model.embed_tokens.weight"]
        vocab = int(get("vocab_size", embed.shape[-1]))
        head_dim = int(get("attention.key_length", hidden // heads))
        cfg: dict[str, Any] = {
            "architectures": [{"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                               "qwen3": "Qwen3ForCausalLM"}[a]],
            "model_type": _ARCHS[a],
            "vocab_size": vocab,
            "hidden_size": hidden,
            "intermediate_size": int(get("feed_forward_length")),
            "num_hidden_layers": int(get("block_count")),
            "num_attention_heads": heads,
            "num_key_value_heads": int(get("attention.head_count_kv", heads)),
            "head_dim": head_dim,
            "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon", 1e-6)),
            "rope_theta": float(get("rope.freq_base", 10000.0)),
            "max_position_embeddings": int(get("context_length", 8192)),
            "tie_word_embeddings": "lm_head.weight" not in self._tensors,
            "bos_token_id": _field(self.reader, "tokenizer.ggml.bos_token_id"),
            "eos_token_id": _field(self.reader, "tokenizer.ggml.eos_token_id"),
            "_name_or_path": str(self.path),
        }
        scaling = get("rope.scaling.type")
        if scaling not in (None, "none"):
            raise InputError(f"GGUF rope scaling {scaling!r} is not supported", path=self.path)
        return cfg

    @property
    def names(self) -> list[str]:
        return list(self._tensors)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(int(d) for d in reversed(self._tensors[name].shape))

    def get(self, name: str) -> np.ndarray:
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize

        t = self._tensors[name]
        qtype = GGMLQuantizationType(t.tensor_type)
        try:
            w = dequantize(t.data, qtype)
        except (NotImplementedError, ValueError) as e:
            raise InputError(f"tensor {t.name!r} has unsupported GGUF type {qtype.name} ({e})",
                             path=self.path) from None
        w = np.asarray(w, np.float32).reshape(self.shape(name))
        if self.arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = self.config["num_attention_heads"]
            if name.endswith("k_proj.weight"):
                heads = self.config["num_key_value_heads"]
            w = _unpermute_rotary(w, heads)
        return w


def _unpermute_rotary(w: np.ndarray, heads: int) -> np.ndarray:
    """Inverse of llama.cpp's per-head interleaving of the rotary halves (rows of Q/K)."""
    half = w.shape[0] // heads // 2
    return w.reshape(heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
