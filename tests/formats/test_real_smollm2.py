"""The real SmolLM2-135M-Instruct target: exports carry its fields, and both engines' loading
gives eagle3kit's draft logits on its real hidden states over a real ShareGPT conversation."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from eagle3kit.core.config import DraftConfig
from eagle3kit.core.draft import DraftWeights
from eagle3kit.core.draft import arrays as draft_arrays
from eagle3kit.core.sharding import make_mesh
from eagle3kit.core.vocab import VocabMap
from eagle3kit.data.chat import render
from eagle3kit.formats import export_draft, load_any_draft
from eagle3kit.io.draft_io import Draft
from eagle3kit.io.hf import load_target, resolve_target
from tests import assets
from tests.formats import engines
from tests.formats.helpers import assert_same_logits, jax_logits, target_states

pytestmark = pytest.mark.slow
NAME = "HuggingFaceTB/SmolLM2-135M-Instruct"


class _Real:
    """The `helpers.Target` interface over the GGUF (JAX weights only)."""

    def __init__(self):
        self.ckpt = resolve_target(assets.smollm2_gguf())
        self.weights = load_target(self.ckpt, make_mesh("data=1,tensor=1", jax.devices()[:1]),
                                   jnp.float32)


@pytest.fixture(scope="module")
def real():
    return _Real()


@pytest.fixture(scope="module")
def conversation():
    """[1, 96] tokens and loss mask of a real conversation, rendered with the chat template."""
    chat = assets.sharegpt_chats(1)[0]
    ids, mask = render(assets.smollm2_tokenizer(), chat.messages)
    return np.asarray(ids[:96])[None], np.asarray(mask[:96])


@pytest.fixture(scope="module")
def draft(real) -> Draft:
    """A draft for the real target: random weights, a vocab of 1024 ids."""
    cfg = DraftConfig.for_target(real.ckpt.config, 1024)
    rng = np.random.default_rng(0)
    abstract = DraftWeights.abstract(cfg)
    w = {}
    for name, info in draft_arrays(abstract).items():
        shape = info.shape
        w[name] = (1 + 0.3 * rng.standard_normal(shape) if len(shape) == 1
                   else rng.standard_normal(shape) / np.sqrt(shape[0])).astype(np.float32)
    counts = rng.integers(0, 1000, cfg.vocab_size) * (rng.random(cfg.vocab_size) < 0.05)
    vocab, _ = VocabMap.from_counts(counts, cfg.draft_vocab_size)
    return Draft(cfg, DraftWeights(**w), vocab, str(assets.smollm2_gguf()),
                 dict(real.ckpt.hf_config), {}, {"epochs": 1})


def _engine_logits(engine, real, tokens, steps=2):
    """The engine's capture of the real target: every layer's input from eagle3kit's forward
    (whose parity with transformers is tests/core/test_target.py), picked by the engine."""
    every, embeds = target_states(real.weights, real.ckpt.config, jnp.asarray(tokens))
    h = real.ckpt.config.hidden_size
    states = [torch.tensor(np.asarray(every[..., i * h:(i + 1) * h]))
              for i in range(real.ckpt.config.num_layers)]
    embeds = torch.tensor(np.asarray(embeds))
    hidden, out = engine.aux(states), []
    with torch.no_grad():
        for k in range(steps):
            pos = torch.arange(tokens.shape[1])[None] + k
            logits, hidden = engine.step(embeds, hidden, pos)
            out.append(logits.numpy())
    return out


@pytest.mark.parametrize("fmt", ["sglang", "speculators"])
def test_real_target_exports(real, draft, conversation, tmp_path, fmt):
    out = export_draft(draft, fmt, tmp_path / fmt, target_name=NAME)  # bf16, as published
    raw = json.loads((out / "config.json").read_text())
    fields = raw if fmt == "sglang" else raw["transformer_layer_config"]
    # from the GGUF header: 30 layers, 9/3 heads, context 8192, theta 1e5, tied embeddings
    assert fields["max_position_embeddings"] == 8192 and fields["rope_theta"] == 100000.0
    assert fields["num_attention_heads"] == 9 and fields["num_key_value_heads"] == 3
    assert fields["head_dim"] == 64 and fields["vocab_size"] == 49152
    assert fields["tie_word_embeddings"] is False  # the target ties; the draft head must not
    assert (fields["bos_token_id"], fields["eos_token_id"]) == (1, 2)
    if fmt == "sglang":
        assert "eagle_config" not in raw  # default layers 2, 15, 27
        engine = engines.load_sglang(out, 30)
    else:
        assert raw["eagle_aux_hidden_state_layer_ids"] == [2, 15, 27]
        assert raw["speculators_config"]["verifier"] == {
            "name_or_path": NAME, "architectures": ["LlamaForCausalLM"]}
        engine = engines.load_vllm(out, 30)
    assert engine.captures == [2, 15, 27]
    published = load_any_draft(out)  # the bf16-rounded weights the engine computes with
    tokens, _ = conversation
    assert_same_logits(_engine_logits(engine, real, tokens), jax_logits(published, real, tokens))
