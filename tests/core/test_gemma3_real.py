"""The real Gemma-3-270M (base, Q4_K_M GGUF) against transformers reading the same file, fp32.

What only a real Gemma-3 shows: K-quants (Q4_K, Q6_K) beside Q5_0, Q8_0 and F32 tensors,
llama.cpp's `1 + w` norms, the hyper-parameters a GGUF header leaves out (five sliding layers
to one global, the local rope base, query scaling), and a 512-token sliding window, which
real prompts longer than 512 tokens exercise. The weights are read once for the module (a
few seconds of dequantising) and the references come from transformers (torch, tests only).
Tolerance as in test_target.py.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from eagle3kit.core.sharding import make_mesh
from eagle3kit.data.chat import render
from eagle3kit.data.tokenizer import KNOWN_TEMPLATES
from eagle3kit.decode.engine import Engine, EngineConfig, Request
from eagle3kit.io.hf import load_target, resolve_target
from tests import assets
from tests.core.gguf_reference import (
    assert_config_is_transformers,
    check_every_tensor,
    check_forward,
)
from tests.decode.hf_reference import greedy_divergence

pytestmark = pytest.mark.slow
T = 640  # prompt tokens: beyond the 512-token window
LAST = 32  # positions whose [V] logits are compared (every position's normed state is)
NEW = 64  # greedy tokens
AUX = (2, 5, 9, 15)  # captured inputs of sliding and global layers


@dataclasses.dataclass
class Gemma:
    ckpt: object
    weights: object
    mesh: object
    model: torch.nn.Module
    tokenizer: object


@pytest.fixture(scope="module")
def gemma():
    ckpt = resolve_target(assets.gemma3_gguf())
    mesh = make_mesh("data=1,tensor=1", jax.devices()[:1])
    return Gemma(ckpt, load_target(ckpt, mesh, jnp.float32), mesh, assets.gemma3_torch(),
                 assets.gemma3_tokenizer())


def long_prompts(tok, n: int, length: int) -> list[list[int]]:
    """The first `n` real ShareGPT conversations of at least `length` tokens in Gemma's
    turn format, cut to `length`."""
    out = []
    for chat in assets.sharegpt_chats(40):
        try:
            ids, _ = render(tok, chat.messages, chat_template=KNOWN_TEMPLATES["gemma"])
        except Exception:  # a conversation the template refuses
            continue
        if len(ids) >= length:
            out.append(ids[:length])
            if len(out) == n:
                return out
    raise AssertionError(f"fewer than {n} conversations of {length} tokens")


def test_config_is_what_transformers_reads(gemma):
    """The header's hyper-parameters and llama.cpp's assumptions give the config
    transformers builds for this file (its config.json mapping, through our reader)."""
    assert_config_is_transformers(gemma.ckpt, gemma.model)
    cfg = gemma.ckpt.config
    assert cfg.layer_windows == (512,) * 5 + (0,) + (512,) * 5 + (0,) + (512,) * 5 + (0,)
    assert cfg.rope.theta == 1e6 and cfg.local_rope.theta == 1e4
    assert cfg.query_scale == 256 ** -0.5 and cfg.vocab_size == 262144
    assert cfg.tie_word_embeddings and cfg.gemma_norms and cfg.attn_softcap == 0


def test_every_tensor_is_the_gguf_packages_and_transformers(gemma):
    """Each tensor as loaded (HF name and layout, norms less llama.cpp's 1) is the `gguf`
    package's dequantisation of its blocks, as transformers loads it too; and, for the types
    transformers also dequantises with its own torch code (Q8_0 and the K-quants Q4_K,
    Q6_K), equal to that independent implementation bit for bit."""
    seen = check_every_tensor(gemma.ckpt, gemma.model, norm_offset=1.0)
    assert seen == {"F32": 109, "Q8_0": 10, "Q5_0": 81, "Q4_K": 27, "Q6_K": 9}


def test_logits_beyond_the_window_match_transformers(gemma):
    """Three real conversations of 640 tokens as one batch: every position's final normed
    state and captured layer inputs, and the logits of the last 32 positions."""
    tokens = np.asarray(long_prompts(gemma.tokenizer, 3, T))
    check_forward(gemma.weights, gemma.ckpt.config, gemma.model, tokens, AUX, LAST)


def test_greedy_decoding_equals_transformers_generate(gemma):
    """64 greedy tokens after a 600-token real prompt (prefilled in two pieces, then decoded
    past the window) equal transformers' `generate`, checked in one forward
    (greedy_divergence: `generate` costs a CPU half a minute here)."""
    prompt = long_prompts(gemma.tokenizer, 1, 600)[0]
    engine = Engine(gemma.ckpt.config, gemma.weights, gemma.mesh, [],
                    EngineConfig(rows=1, max_context=1024, sync_every=NEW))
    got = engine.generate([Request(0, prompt, NEW)])[0].tokens
    assert len(got) == NEW
    at = greedy_divergence(gemma.model, prompt, got)
    assert at is None, f"leaves greedy decoding at token {at}"
