"""The EAGLE3 draft head: abstract shapes for real 8B configs, and numerics against an
independent PyTorch implementation written here from the reference description."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from eagle3kit.core import draft, layers
from eagle3kit.core.config import DraftConfig, TargetConfig
from eagle3kit.core.draft import arrays as draft_arrays
from eagle3kit.core.sharding import init_weights
from eagle3kit.core.vocab import VocabMap
from eagle3kit.errors import InputError
from eagle3kit.io.draft_io import Draft, load_draft, save_draft

LLAMA_31_8B = {
    "model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 128256,
    "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
    "num_attention_heads": 32, "num_key_value_heads": 8, "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0, "max_position_embeddings": 131072, "tie_word_embeddings": False,
    "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
}
QWEN3_8B = {
    "model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "vocab_size": 151936,
    "hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 36,
    "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
    "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "max_position_embeddings": 40960,
    "tie_word_embeddings": False,
}


@pytest.mark.parametrize("hf,aux", [(LLAMA_31_8B, (2, 16, 29)), (QWEN3_8B, (2, 18, 33))])
def test_shapes_for_8b_targets(hf, aux):
    tcfg = TargetConfig.from_hf_config(hf)
    cfg = DraftConfig.for_target(tcfg, 32000)
    assert cfg.aux_layer_ids == aux
    assert cfg.max_position_embeddings == tcfg.max_position_embeddings
    abstract = draft.DraftWeights.abstract(cfg, jnp.float32)
    w = jax.eval_shape(lambda: jax.tree.map(
        lambda i: jnp.zeros(i.shape, i.dtype), abstract,
        is_leaf=lambda x: hasattr(x, "axes")))
    assert w.fc.shape == (3 * 4096, 4096)
    assert w.q.shape == (8192, 32, 128) and w.k.shape == (8192, 8, 128)
    assert w.lm_head.shape == (4096, 32000) and w.fc.dtype == jnp.float32
    b, t = 2, 16

    def fwd(w, aux, tokens_embeds):
        g = draft.fuse(w, cfg, aux)
        pos = jnp.broadcast_to(jnp.arange(t), (b, t))
        mask = layers.causal_mask(jnp.ones((b, t), jnp.int32))
        w16 = draft.cast(w, jnp.bfloat16)
        h, _ = draft.step(w16, cfg, tokens_embeds, g.astype(jnp.bfloat16), pos,
                          draft.masked(mask))
        return draft.head(w16, cfg, h), h

    logits, h = jax.eval_shape(fwd, w, jax.ShapeDtypeStruct((b, t, 3 * 4096), jnp.bfloat16),
                               jax.ShapeDtypeStruct((b, t, 4096), jnp.bfloat16))
    assert logits.shape == (b, t, 32000) and logits.dtype == jnp.bfloat16
    assert h.shape == (b, t, 4096)
    # about 0.3B trainable parameters for Llama-3.1-8B, as the published heads
    assert 2.5e8 < cfg.num_params < 4.5e8


class TorchEagle3(torch.nn.Module):
    """Independent reference: HF-layout weights, SGLang's documented step semantics."""

    def __init__(self, sd, cfg: DraftConfig):
        super().__init__()
        self.sd, self.cfg = sd, cfg

    def rms(self, x, w):
        v = x.pow(2).mean(-1, keepdim=True)
        return w * (x * torch.rsqrt(v + self.cfg.rms_norm_eps))

    def forward(self, embeds, hidden, positions):
        sd, c = self.sd, self.cfg
        if hidden.shape[-1] != c.hidden_size:
            if c.fc_norm:  # EAGLE-3.1: each captured state normed on its own
                hidden = torch.cat([self.rms(x, sd[f"fc_norm.{i}.weight"]) for i, x in
                                    enumerate(hidden.chunk(len(c.aux_layer_ids), -1))], -1)
            hidden = hidden @ sd["fc.weight"].T
        residual = hidden
        x = torch.cat([self.rms(embeds, sd["midlayer.input_layernorm.weight"]),
                       self.rms(hidden, sd["midlayer.hidden_norm.weight"])], -1)
        b, t, _ = x.shape
        q = (x @ sd["midlayer.self_attn.q_proj.weight"].T).view(b, t, c.num_heads, c.head_dim)
        k = (x @ sd["midlayer.self_attn.k_proj.weight"].T).view(b, t, c.num_kv_heads, c.head_dim)
        v = (x @ sd["midlayer.self_attn.v_proj.weight"].T).view(b, t, c.num_kv_heads, c.head_dim)
        inv = torch.tensor(c.rope.inv_freq(c.head_dim))
        ang = positions[..., None].float() * inv
        ang = torch.cat([ang, ang], -1)[:, :, None]

        def rot(z):
            z1, z2 = z[..., : c.head_dim // 2], z[..., c.head_dim // 2:]
            return z * ang.cos() + torch.cat([-z2, z1], -1) * ang.sin()

        q, k = rot(q), rot(k)
        rep = c.num_heads // c.num_kv_heads
        k, v = k.repeat_interleave(rep, 2), v.repeat_interleave(rep, 2)
        a = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        a = a.transpose(1, 2).reshape(b, t, -1)
        h = residual + a @ sd["midlayer.self_attn.o_proj.weight"].T
        m = self.rms(h, sd["midlayer.post_attention_layernorm.weight"])
        mlp = (torch.nn.functional.silu(m @ sd["midlayer.mlp.gate_proj.weight"].T)
               * (m @ sd["midlayer.mlp.up_proj.weight"].T)) @ sd["midlayer.mlp.down_proj.weight"].T
        h = h + mlp
        normed = self.rms(h, sd["norm.weight"])
        # norm_output (speculators, vLLM): the post-norm state is what the next step reads
        return normed @ sd["lm_head.weight"].T, normed if c.norm_output else h


def hf_layout(w: draft.DraftWeights, cfg: DraftConfig) -> dict[str, torch.Tensor]:
    """eagle3kit (in, out) layout -> HF [out, in] names, written independently of convert."""
    a = {k: torch.tensor(np.asarray(getattr(w, k))) for k in draft_arrays(w)}
    return {
        "fc.weight": a["fc"].T,
        "midlayer.hidden_norm.weight": a["hidden_norm"],
        "midlayer.input_layernorm.weight": a["input_norm"],
        "midlayer.self_attn.q_proj.weight": a["q"].reshape(2 * cfg.hidden_size, -1).T,
        "midlayer.self_attn.k_proj.weight": a["k"].reshape(2 * cfg.hidden_size, -1).T,
        "midlayer.self_attn.v_proj.weight": a["v"].reshape(2 * cfg.hidden_size, -1).T,
        "midlayer.self_attn.o_proj.weight": a["o"].reshape(-1, cfg.hidden_size).T,
        "midlayer.post_attention_layernorm.weight": a["post_attn_norm"],
        "midlayer.mlp.gate_proj.weight": a["gate"].T,
        "midlayer.mlp.up_proj.weight": a["up"].T,
        "midlayer.mlp.down_proj.weight": a["down"].T,
        "norm.weight": a["final_norm"],
        "lm_head.weight": a["lm_head"].T,
        **{f"fc_norm.{i}.weight": x for i, x in enumerate(a.get("fc_norm", []))},
    }


def tiny_draft_config():
    tcfg = TargetConfig.from_hf_config({**LLAMA_31_8B, "hidden_size": 64, "intermediate_size": 96,
                                        "num_attention_heads": 4, "num_key_value_heads": 2,
                                        "vocab_size": 300, "num_hidden_layers": 8,
                                        "max_position_embeddings": 512,
                                        "rope_scaling": {**LLAMA_31_8B["rope_scaling"],
                                                         "original_max_position_embeddings": 32}})
    return DraftConfig.for_target(tcfg, draft_vocab_size=120)


def random_weights(cfg, seed=0):
    w = init_weights(draft.DraftWeights.abstract(cfg), jax.random.key(seed))
    # norms are ones at init; perturb so that a swapped norm is caught
    rng = np.random.default_rng(seed)
    for name in ("hidden_norm", "input_norm", "post_attn_norm", "final_norm"):
        setattr(w, name, jnp.asarray(1 + 0.3 * rng.standard_normal(cfg.hidden_size),
                                     jnp.float32))
    if w.fc_norm is not None:
        w.fc_norm = jnp.asarray(1 + 0.3 * rng.standard_normal(w.fc_norm.shape), jnp.float32)
    return w


@pytest.mark.parametrize("arch", ["eagle3", "eagle3.1", "eagle3.1-fc"])
def test_two_steps_match_torch_reference(arch):
    cfg = tiny_draft_config().with_arch(arch)
    w = random_weights(cfg)
    ref = TorchEagle3(hf_layout(w, cfg), cfg)
    rng = np.random.default_rng(1)
    b, t = 2, 12
    embeds = rng.standard_normal((b, t, cfg.hidden_size)).astype(np.float32)
    aux = rng.standard_normal((b, t, 3 * cfg.hidden_size)).astype(np.float32)
    pos = np.broadcast_to(np.arange(t) + 5, (b, t))
    mask = layers.causal_mask(jnp.ones((b, t), jnp.int32))
    h, _ = draft.step(w, cfg, jnp.asarray(embeds), draft.fuse(w, cfg, jnp.asarray(aux)),
                      jnp.asarray(pos), draft.masked(mask))
    logits = draft.head(w, cfg, h)
    with torch.no_grad():
        r_logits, r_h = ref(torch.tensor(embeds), torch.tensor(aux), torch.tensor(pos))
        # the second step feeds the pre-norm h back in place of g
        r_logits2, _ = ref(torch.tensor(embeds), r_h, torch.tensor(pos) + 1)
    h2, _ = draft.step(w, cfg, jnp.asarray(embeds), h, jnp.asarray(pos) + 1, draft.masked(mask))
    logits2 = draft.head(w, cfg, h2)
    for a, r in [(logits, r_logits), (h, r_h), (logits2, r_logits2)]:
        np.testing.assert_allclose(np.asarray(a), r.numpy(), rtol=2e-4, atol=2e-4)


def test_draft_format_round_trip(tmp_path):
    cfg = tiny_draft_config()
    w = random_weights(cfg, 3)
    vocab = VocabMap.from_ids(np.arange(0, 240, 2), cfg.vocab_size)
    save_draft(tmp_path / "d", Draft(cfg, w, vocab, "tiny", {"model_type": "llama"},
                                     {"tokenizer": "300:abc"}))
    back = load_draft(tmp_path / "d")
    assert back.config == cfg and back.target_name == "tiny"
    for name in draft_arrays(w):
        np.testing.assert_array_equal(getattr(back.weights, name), np.asarray(getattr(w, name)))
    np.testing.assert_array_equal(back.vocab.d2t, vocab.d2t)
    with pytest.raises(FileExistsError):
        save_draft(tmp_path / "d", back)


def test_architecture_names_round_trip_and_an_unnamed_mix_is_still_named():
    cfg = tiny_draft_config()
    for name in ("eagle3", "eagle3.1", "eagle3.1-fc"):
        assert cfg.with_arch(name).arch == name
    # a draft imported with only speculators' norm_output: runnable, named by its flags
    assert dataclasses.replace(cfg, norm_output=True).arch == "eagle3+norm_output"
    with pytest.raises(InputError, match="eagle3, eagle3.1, eagle3.1-fc"):
        cfg.with_arch("eagle4")
