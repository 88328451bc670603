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

from eagle3kit.core import target
from eagle3kit.core.config import TargetConfig
from eagle3kit.core.sharding import make_mesh
from eagle3kit.data.chat import render
from eagle3kit.data.tokenizer import KNOWN_TEMPLATES
from eagle3kit.decode.engine import Engine, EngineConfig, Request
from eagle3kit.io.hf import load_target, resolve_target
from tests import assets
from tests.core.test_target import assert_close
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
    cfg = gemma.ckpt.config
    hf = gemma.model.config.to_dict()
    del hf["quantization_config"]  # transformers' note that it read a GGUF
    ref = TargetConfig.from_hf_config(hf)
    anonymous = {"name": "", "architectures": ()}  # transformers' GGUF config names none
    assert dataclasses.replace(cfg, **anonymous) == dataclasses.replace(ref, **anonymous)
    assert cfg.layer_windows == (512,) * 5 + (0,) + (512,) * 5 + (0,) + (512,) * 5 + (0,)
    assert cfg.rope.theta == 1e6 and cfg.local_rope.theta == 1e4
    assert cfg.query_scale == 256 ** -0.5 and cfg.vocab_size == 262144
    assert cfg.tie_word_embeddings and cfg.gemma_norms and cfg.attn_softcap == 0


def test_every_tensor_is_the_gguf_packages_and_transformers(gemma):
    """Each tensor as loaded (HF name and layout, norms less llama.cpp's 1) is the `gguf`
    package's dequantisation of its blocks, as transformers loads it too; and, for the types
    transformers also dequantises with its own torch code (Q8_0 and the K-quants Q4_K,
    Q6_K), equal to that independent implementation bit for bit."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize
    from transformers.integrations.gguf import dequant as torch_dequant

    src = gemma.ckpt.source
    state = gemma.model.state_dict()
    seen: dict[str, int] = {}
    for hf_name, t in src._tensors.items():
        qtype = GGMLQuantizationType(t.tensor_type)
        ours = src.get(hf_name)
        raw = np.asarray(dequantize(t.data, qtype), np.float32)
        raw = raw.reshape(ours.shape) - np.float32(hf_name.endswith("norm.weight"))
        assert np.array_equal(ours, raw), hf_name
        np.testing.assert_array_equal(ours, state[hf_name].numpy(), err_msg=hf_name)
        if qtype.value in torch_dequant.GGML_BLOCK:
            blocks = torch.from_numpy(np.array(t.data).reshape(-1))  # a writable copy
            independent = torch_dequant.dequantize(blocks, qtype.value).numpy()
            np.testing.assert_array_equal(ours.reshape(-1), independent,
                                          err_msg=f"{hf_name} ({qtype.name})")
        seen[qtype.name] = seen.get(qtype.name, 0) + 1
    assert seen == {"F32": 109, "Q8_0": 10, "Q5_0": 81, "Q4_K": 27, "Q6_K": 9}


def test_logits_beyond_the_window_match_transformers(gemma):
    """Three real conversations of 640 tokens as one batch: every position's final normed
    state and captured layer inputs, and the logits of the last 32 positions."""
    cfg = gemma.ckpt.config
    tokens = np.asarray(long_prompts(gemma.tokenizer, 3, T))

    @jax.jit
    def run(w, tokens):
        out = target.forward(w, cfg, tokens, aux_layer_ids=AUX)
        return out.hidden_BxTxD, target.logits(w, out.hidden_BxTxD[:, -LAST:]), out.aux_BxTxA

    hidden, logits, aux = (np.asarray(x) for x in run(gemma.weights, jnp.asarray(tokens)))
    with torch.no_grad():
        out = gemma.model.model(torch.tensor(tokens), output_hidden_states=True)
        ref_logits = gemma.model.lm_head(out.last_hidden_state[:, -LAST:]).numpy()
    assert_close(hidden, out.last_hidden_state.numpy(), "final normed state")
    assert_close(logits, ref_logits, "logits of the last positions")
    d = cfg.hidden_size
    for j, i in enumerate(AUX):
        assert_close(aux[..., j * d:(j + 1) * d], out.hidden_states[i].numpy(),
                     f"hidden_states[{i}]")


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
