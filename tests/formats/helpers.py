"""Tiny targets and drafts for format tests, and the JAX side of the engine comparisons."""

from __future__ import annotations

import copy
import dataclasses
import functools
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import torch

from eagle3kit.core import draft, layers, peagle, target
from eagle3kit.core.config import DraftConfig
from eagle3kit.core.sharding import make_mesh
from eagle3kit.core.vocab import VocabMap
from eagle3kit.io.draft_io import Draft
from eagle3kit.io.hf import load_target, resolve_target
from tests import assets


@dataclasses.dataclass
class Target:
    directory: Path
    model: torch.nn.Module  # transformers' own forward: the engines' hidden states
    ckpt: object

    @functools.cached_property
    def weights(self):
        """JAX TargetWeights (fp32), loaded on first use."""
        mesh = make_mesh("data=1,tensor=1", jax.devices()[:1])
        return load_target(self.ckpt, mesh, jnp.float32)

    @property
    def hf_config(self) -> dict:
        return self.ckpt.hf_config

    @property
    def num_layers(self) -> int:
        return self.ckpt.config.num_layers


def tiny_target(directory: Path, family: str = "llama", layers: int = 8) -> Target:
    """assets.TINY's model (Llama: Llama-3 rope scaling, GQA; Qwen3: q/k norms, tied
    embeddings, head_dim 16) with 8 layers, so the default capture layers 2, N//2, N-3 are
    distinct as they are for real targets."""
    import transformers

    torch.manual_seed(0)
    cfg = transformers.AutoConfig.for_model(**{**copy.deepcopy(assets.TINY[family]),
                                               "num_hidden_layers": layers})
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():  # norms start at one; perturb them so a swapped norm cannot pass
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    model.eval()
    model.save_pretrained(directory, safe_serialization=True)
    return Target(directory, model, resolve_target(directory))


def make_draft(t: Target, *, aux_layer_ids=None, draft_vocab: int = 40, seed: int = 0,
               norm_before_residual: bool = False, name: str = "org/tiny-llama",
               training: dict | None = None, arch: str = "eagle3") -> Draft:
    cfg = DraftConfig.for_target(t.ckpt.config, draft_vocab, aux_layer_ids).with_arch(arch)
    cfg = dataclasses.replace(cfg, norm_before_residual=norm_before_residual)
    rng = np.random.default_rng(seed)
    abstract = draft.DraftWeights.abstract(cfg)
    values = {}
    for field, info in draft.arrays(abstract).items():
        shape = info.shape
        if len(shape) == 1 or field == "fc_norm":  # norms: around one, perturbed so a
            # swapped norm cannot pass
            values[field] = 1 + 0.3 * rng.standard_normal(shape)
        else:
            fan_in = shape[0] * (shape[1] if field == "o" else 1)
            values[field] = rng.standard_normal(shape) / np.sqrt(fan_in)
    w = draft.DraftWeights(**{k: v.astype(np.float32) for k, v in values.items()})
    used = rng.choice(cfg.vocab_size, draft_vocab, replace=False)
    vocab = VocabMap.from_ids(used, cfg.vocab_size)
    return Draft(cfg, w, vocab, name, dict(t.hf_config), {"tokenizer": "96:test"},
                 training or {})


def peagle_draft(t: Target, num_layers: int, fc_norm: bool, seed: int = 0) -> Draft:
    """A random P-EAGLE draft (core/peagle.py) of `num_layers` layers, block 4, mask id 7."""
    cfg = DraftConfig.for_target(t.ckpt.config, 40).with_arch("peagle")
    cfg = dataclasses.replace(cfg, num_layers=num_layers, fc_norm=fc_norm, mask_token_id=7,
                              block_size=4)
    rng = np.random.default_rng(seed)
    values = {}
    for field, info in draft.arrays(peagle.PEagleWeights.abstract(cfg)).items():
        shape = info.shape
        if "norm" in field:  # around one, perturbed so that a swapped norm cannot pass
            values[field] = 1 + 0.3 * rng.standard_normal(shape)
        elif field in ("embed", "mask_hidden"):
            values[field] = rng.standard_normal(shape)
        else:
            lead = 1 if field.startswith("layers_") else 0
            fan_in = shape[lead] * (shape[lead + 1] if field.endswith("o") else 1)
            values[field] = rng.standard_normal(shape) / np.sqrt(fan_in)
    w = peagle.PEagleWeights(**{k: v.astype(np.float32) for k, v in values.items()})
    vocab = VocabMap.from_ids(rng.choice(cfg.vocab_size, 40, replace=False), cfg.vocab_size)
    return Draft(cfg, w, vocab, "org/tiny-llama", dict(t.hf_config), {"tokenizer": "96:test"})


@functools.partial(jax.jit, static_argnums=1)
def target_states(w, cfg, tokens):
    """Every layer's input captured once (one compile), sliced per draft below."""
    out = target.forward(w, cfg, tokens, aux_layer_ids=tuple(range(cfg.num_layers)))
    return out.aux_BxTxA, target.embed_tokens(w, tokens)


def jax_logits(d: Draft, t: Target, tokens: np.ndarray, steps: int = 2) -> list[np.ndarray]:
    """eagle3kit's own forward: target capture, then `steps` draft steps (the hidden input of
    step k > 0 is step k-1's pre-norm output) -> logits over the target vocab, -inf off the
    draft vocab, [B, T, V] per step."""
    every, embeds = target_states(t.weights, t.ckpt.config, jnp.asarray(tokens))
    h = t.ckpt.config.hidden_size
    aux = jnp.concatenate([every[..., i * h:(i + 1) * h] for i in d.config.aux_layer_ids], -1)
    w = jax.tree.map(jnp.asarray, d.weights)
    b, n = tokens.shape
    mask = layers.causal_mask(jnp.ones((b, n), jnp.int32))
    hidden = draft.fuse(w, d.config, aux)
    out = []
    for k in range(steps):
        pos = jnp.broadcast_to(jnp.arange(n) + k, (b, n))
        hidden, _ = draft.step(w, d.config, embeds, hidden, pos, draft.masked(mask))
        logits = draft.head(w, d.config, hidden)
        full = np.full((b, n, d.config.vocab_size), -np.inf, np.float32)
        full[..., d.vocab.used_ids] = np.asarray(logits)
        out.append(full)
    return out


def engine_logits(engine, t: Target, tokens: np.ndarray, steps: int = 2) -> list[np.ndarray]:
    """The same rollout through an engine re-implementation, on transformers' hidden states."""
    with torch.no_grad():
        out = t.model(torch.tensor(tokens), output_hidden_states=True)
        embeds = t.model.get_input_embeddings()(torch.tensor(tokens))
        hidden = engine.aux(out.hidden_states)
        b, n = tokens.shape
        result = []
        for k in range(steps):
            pos = torch.arange(n).expand(b, n) + k
            logits, hidden = engine.step(embeds, hidden, pos)
            result.append(logits.numpy())
    return result


def assert_same_logits(actual: list[np.ndarray], expected: list[np.ndarray], rtol=2e-4):
    """Same -inf pattern (the d2t mapping) and finite values within rtol of their scale.

    fp32 on both sides, different summation order (XLA vs ATen): ~1e-6 relative; a wrong
    layer, norm, layout or mapping misses by orders of magnitude.
    """
    for k, (a, e) in enumerate(zip(actual, expected, strict=True)):
        assert a.shape == e.shape, k
        np.testing.assert_array_equal(np.isfinite(a), np.isfinite(e), err_msg=f"step {k}")
        fin = np.isfinite(e)
        scale = np.abs(e[fin]).max()
        err = np.abs(a[fin] - e[fin]).max()
        assert err <= rtol * scale, f"step {k}: max error {err:.3g} vs scale {scale:.3g}"
