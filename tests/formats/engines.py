"""Independent PyTorch re-implementations of how SGLang and vLLM load and run an EAGLE3 draft.

Written from the engines' loaders (sglang `srt/models/llama_eagle3.py` and `llama.py`'s
capture; vllm `model_executor/models/llama_eagle3.py`, `configs/speculators/algos.py`,
`eagle3_utils.py`) and never from eagle3kit's code: config parsing goes through
transformers' `LlamaConfig` and rotary embedding (what both engines build on), weights are
loaded by the engines' name rules (fused qkv / gate_up, `midlayer.` -> `layers.0.`, d2t
turned into target ids, t2d skipped), and the capture layers are decoded in each engine's
own convention. A loader rule an export breaks (a tensor the engine would silently skip, a
missing d2t, an embed_tokens vLLM would use) fails here.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import transformers
from safetensors.torch import load_file
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding


def _rms(x, w, eps):
    x32 = x.float()
    return w * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


class EngineDraft:
    """A loaded draft: fused params as the engine holds them, and its forward step."""

    def __init__(self, cfg: transformers.LlamaConfig, params: dict[str, torch.Tensor],
                 draft_to_target: torch.Tensor, captures: list[int],
                 norm_before_residual: bool, target_hidden: int, norm_output: bool = False):
        self.cfg, self.p, self.captures = cfg, params, captures
        self.norm_output = norm_output
        self.draft_to_target = draft_to_target
        self.norm_before_residual = norm_before_residual
        self.target_hidden = target_hidden
        self.rope = LlamaRotaryEmbedding(cfg)
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads

    def aux(self, hidden_states: tuple[torch.Tensor, ...]) -> torch.Tensor:
        """The engine's capture: walking the target's layers, the input of layer c (HF
        hidden_states[c]) is appended when c is a capture layer, so the states arrive in
        layer order, once per layer, whatever order the config lists them in."""
        picked = [hidden_states[c] for c in range(len(hidden_states)) if c in self.captures]
        return torch.cat(picked, dim=-1)

    def step(self, embeds, hidden, positions):
        """One draft step -> (logits over the target vocab (-inf off the draft vocab), the
        hidden for the next step: pre-norm, or the normed one with `norm_output`)."""
        p, c, eps = self.p, self.cfg, self.cfg.rms_norm_eps
        if hidden.shape[-1] != c.hidden_size:
            if "fc_norm" in p:  # EAGLE-3.1: an RMSNorm per captured chunk before fc
                chunks = hidden.chunk(len(p["fc_norm"]), -1)
                hidden = torch.cat([_rms(x, w, eps) for x, w in zip(chunks, p["fc_norm"], strict=True)], -1)
            hidden = hidden @ p["fc"].T
        if self.norm_before_residual:
            hn = _rms(hidden, p["hidden_norm"], eps)
            residual = hn
        else:
            residual = hidden
            hn = _rms(hidden, p["hidden_norm"], eps)
        x = torch.cat([_rms(embeds, p["input_layernorm"], eps), hn], -1)
        b, t, _ = x.shape
        nq, nk, hd = c.num_attention_heads, c.num_key_value_heads, self.head_dim
        q, k, v = (x @ p["qkv"].T).split([nq * hd, nk * hd, nk * hd], -1)
        q, k, v = (z.view(b, t, -1, hd).transpose(1, 2) for z in (q, k, v))
        cos, sin = self.rope(x, positions)
        cos, sin = cos[:, None], sin[:, None]

        def rot(z):
            z1, z2 = z[..., : hd // 2], z[..., hd // 2:]
            return z * cos + torch.cat([-z2, z1], -1) * sin

        q, k = rot(q), rot(k)
        k, v = k.repeat_interleave(nq // nk, 1), v.repeat_interleave(nq // nk, 1)
        a = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        h = residual + a.transpose(1, 2).reshape(b, t, -1) @ p["o_proj"].T
        m = _rms(h, p["post_attention_layernorm"], eps)
        gate, up = (m @ p["gate_up"].T).chunk(2, -1)
        h = h + (torch.nn.functional.silu(gate) * up) @ p["down_proj"].T
        normed = _rms(h, p["norm"], eps)
        logits = normed @ p["lm_head"].T
        full = logits.new_full((b, t, c.vocab_size), float("-inf"))
        full[..., self.draft_to_target] = logits
        return full, normed if self.norm_output else h


def _fuse(tensors: dict[str, torch.Tensor], layer: str) -> tuple[dict, set[str]]:
    """The engines' stacked-param mapping: q/k/v -> qkv_proj, gate/up -> gate_up_proj."""
    attn, mlp = f"{layer}self_attn.", f"{layer}mlp."
    names = {
        "fc": "fc.weight", "hidden_norm": f"{layer}hidden_norm.weight",
        "input_layernorm": f"{layer}input_layernorm.weight",
        "o_proj": f"{attn}o_proj.weight",
        "post_attention_layernorm": f"{layer}post_attention_layernorm.weight",
        "down_proj": f"{mlp}down_proj.weight", "norm": "norm.weight", "lm_head": "lm_head.weight",
    }
    p = {k: tensors[v].float() for k, v in names.items()}
    p["qkv"] = torch.cat([tensors[f"{attn}{x}_proj.weight"].float() for x in "qkv"])
    p["gate_up"] = torch.cat([tensors[f"{mlp}{x}_proj.weight"].float() for x in ("gate", "up")])
    used = set(names.values()) | {f"{attn}{x}_proj.weight" for x in "qkv"}
    used |= {f"{mlp}{x}_proj.weight" for x in ("gate", "up")}
    return p, used


def _check_shapes(p: dict, cfg, target_hidden: int, draft_vocab: int):
    h, hd = cfg.hidden_size, getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    qkv = (cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * hd
    expected = {"fc": (h, 3 * target_hidden), "qkv": (qkv, 2 * h),
                "o_proj": (h, cfg.num_attention_heads * hd),
                "gate_up": (2 * cfg.intermediate_size, h), "down_proj": (h, cfg.intermediate_size),
                "lm_head": (draft_vocab, h), "norm": (h,), "hidden_norm": (h,),
                "input_layernorm": (h,), "post_attention_layernorm": (h,)}
    for k, shape in expected.items():
        assert tuple(p[k].shape) == shape, (k, tuple(p[k].shape), shape)


def load_sglang(directory: Path, target_layers: int) -> EngineDraft:
    """SGLang's LlamaForCausalLMEagle3: config via transformers, weights by its load rules."""
    raw = json.loads((directory / "config.json").read_text())
    assert "LlamaForCausalLMEagle3" in raw["architectures"]
    cfg = transformers.LlamaConfig.from_dict(raw)
    # tie_word_embeddings would make lm_head the (target's) embedding; None draft vocab would
    # load the target's lm_head instead of ours
    assert cfg.tie_word_embeddings is False and raw.get("draft_vocab_size")
    tensors = load_file(str(directory / "model.safetensors"))
    assert tensors["d2t"].dtype == torch.int64 and tensors["t2d"].dtype == torch.bool
    hot = tensors["d2t"] + torch.arange(tensors["d2t"].shape[0])
    p, used = _fuse(tensors, "midlayer.")
    # EAGLE-3.1 as SGLang 0.5.23 reads it: the flags at the config's top level
    if raw.get("fc_norm") or raw.get("use_aux_norm"):
        names = [f"fc_norm.{i}.weight" for i in range(3)]
        p["fc_norm"] = [tensors[n].float() for n in names]
        used |= set(names)
    # SGLang silently skips names it has no parameter for: each one would stay random
    unknown = set(tensors) - used - {"d2t", "t2d"}
    assert not unknown, f"SGLang would ignore {unknown}"
    target_hidden = int(raw.get("target_hidden_size") or cfg.hidden_size)
    _check_shapes(p, cfg, target_hidden, raw["draft_vocab_size"])
    eagle = raw.get("eagle_config") or {}
    ids = eagle.get("eagle_aux_hidden_state_layer_ids")
    n = target_layers
    captures = [i + 1 for i in ids] if ids else [2, n // 2, n - 3]  # set_eagle3_layers_to_capture
    # SGLang's midlayer always keeps the un-normed hidden state as the residual
    return EngineDraft(cfg, p, hot, captures, False, target_hidden,
                       norm_output=bool(raw.get("norm_output", False)))


def load_vllm(directory: Path, target_layers: int) -> EngineDraft:
    """vLLM's Eagle3LlamaForCausalLM, from a speculators or a midlayer checkpoint."""
    raw = json.loads((directory / "config.json").read_text())
    if "speculators_model_type" in raw:  # SpeculatorsConfig + update_eagle3
        spec = raw["speculators_config"]
        assert spec["proposal_methods"][0]["speculative_tokens"] >= 1
        assert spec["verifier"]["name_or_path"]
        model = dict(raw["transformer_layer_config"])
        model["draft_vocab_size"] = raw.get("draft_vocab_size")
        if raw.get("target_hidden_size") is not None:
            model["target_hidden_size"] = raw["target_hidden_size"]
        model["norm_before_residual"] = raw.get("norm_before_residual", True)
        if raw.get("eagle_aux_hidden_state_layer_ids"):
            model["eagle_aux_hidden_state_layer_ids"] = raw["eagle_aux_hidden_state_layer_ids"]
    else:
        model = dict(raw)
    cfg = transformers.LlamaConfig.from_dict(model)
    tensors = load_file(str(directory / "model.safetensors"))
    # vLLM loads and uses an embed_tokens it finds: a stale one ruins acceptance
    assert not any("embed_tokens" in k for k in tensors)
    assert "d2t" in tensors, "vLLM would silently assume the identity mapping"
    d2t = tensors["d2t"]
    assert d2t.dtype == torch.int64
    renamed = {k.replace("midlayer.", "layers.0."): v for k, v in tensors.items()}
    p, used = _fuse(renamed, "layers.0.")
    unknown = set(renamed) - used - {"d2t", "t2d"}
    assert not unknown, f"vLLM's AutoWeightsLoader would reject {unknown}"
    target_hidden = int(model.get("target_hidden_size") or cfg.hidden_size)
    draft_vocab = model.get("draft_vocab_size") or cfg.vocab_size
    _check_shapes(p, cfg, target_hidden, draft_vocab)
    ids = model.get("eagle_aux_hidden_state_layer_ids")
    n = target_layers
    captures = list(ids) if ids else [2, n // 2, n - 3]  # hidden_states indices
    return EngineDraft(cfg, p, torch.arange(draft_vocab) + d2t, captures,
                       bool(model.get("norm_before_residual", False)), target_hidden)
