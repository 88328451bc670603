"""Checks of a real GGUF target against transformers reading the same file (fp32), shared by
the real-model modules (test_gemma3_real.py, test_qwen2_real.py): the config, every tensor
against two independent dequantisations, and one batched forward."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import torch

from eagle3kit.core import target
from eagle3kit.core.config import TargetConfig
from eagle3kit.data.chat import render
from tests import assets
from tests.core.test_target import assert_close


def assert_config_is_transformers(ckpt, model) -> None:
    """The header's hyper-parameters give the config transformers builds for the file."""
    hf = model.config.to_dict()
    del hf["quantization_config"]  # transformers' note that it read a GGUF
    ref = TargetConfig.from_hf_config(hf)
    anonymous = {"name": "", "architectures": ()}  # transformers' GGUF config names none
    assert dataclasses.replace(ckpt.config, **anonymous) == dataclasses.replace(ref, **anonymous)


def check_every_tensor(ckpt, model, norm_offset: float = 0.0) -> dict[str, int]:
    """Each tensor as loaded (HF name and layout, norms less `norm_offset`: llama.cpp's 1 for
    Gemma) is the `gguf` package's dequantisation of its blocks, as transformers loads it
    too; and, for the types transformers also dequantises with its own torch code (Q8_0 and
    the K-quants Q4_K, Q6_K), equal to that independent implementation bit for bit.
    Returns how many tensors of each GGML type there are."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize
    from transformers.integrations.gguf import dequant as torch_dequant

    src = ckpt.source
    state = model.state_dict()
    seen: dict[str, int] = {}
    for hf_name, t in src._tensors.items():
        qtype = GGMLQuantizationType(t.tensor_type)
        ours = src.get(hf_name)
        raw = np.asarray(dequantize(t.data, qtype), np.float32)
        raw = raw.reshape(ours.shape) - np.float32(norm_offset * hf_name.endswith("norm.weight"))
        assert np.array_equal(ours, raw), hf_name
        np.testing.assert_array_equal(ours, state[hf_name].numpy(), err_msg=hf_name)
        if qtype.value in torch_dequant.GGML_BLOCK:
            blocks = torch.from_numpy(np.array(t.data).reshape(-1))  # a writable copy
            independent = torch_dequant.dequantize(blocks, qtype.value).numpy()
            np.testing.assert_array_equal(ours.reshape(-1), independent,
                                          err_msg=f"{hf_name} ({qtype.name})")
        seen[qtype.name] = seen.get(qtype.name, 0) + 1
    return seen


def sharegpt_rows(tokenizer, rows: int, length: int) -> np.ndarray:
    """The first `rows` real ShareGPT conversations (of the first 20) of at least `length`
    tokens in the tokenizer's own chat template, cut to `length`: [rows, length]."""
    tokens = []
    for chat in assets.sharegpt_chats(20):
        ids, _ = render(tokenizer, chat.messages)
        if len(ids) >= length:
            tokens.append(ids[:length])
        if len(tokens) == rows:
            break
    return np.asarray(tokens)


def check_forward(weights, cfg, model, tokens: np.ndarray, aux_ids: tuple[int, ...],
                  last: int) -> None:
    """One batch: every position's final normed state and captured layer inputs, and the
    logits of the last `last` positions, against transformers' forward."""

    @jax.jit
    def run(w, tokens):
        out = target.forward(w, cfg, tokens, aux_layer_ids=aux_ids)
        return out.hidden_BxTxD, target.logits(w, out.hidden_BxTxD[:, -last:]), out.aux_BxTxA

    hidden, logits, aux = (np.asarray(x) for x in run(weights, jnp.asarray(tokens)))
    with torch.no_grad():
        out = model.model(torch.tensor(tokens), output_hidden_states=True)
        ref_logits = model.lm_head(out.last_hidden_state[:, -last:]).numpy()
    assert_close(hidden, out.last_hidden_state.numpy(), "final normed state")
    assert_close(logits, ref_logits, "logits of the last positions")
    d = cfg.hidden_size
    for j, i in enumerate(aux_ids):
        assert_close(aux[..., j * d:(j + 1) * d], out.hidden_states[i].numpy(),
                     f"hidden_states[{i}]")


def chat_stop_ids(tok) -> list[int]:
    """What transformers' `generate` stops at for a chat answer of a Qwen2.5 instruct model:
    its generation_config.json lists both `<|im_end|>` (the end of a turn) and
    `<|endoftext|>`. A GGUF names one of them its eos, and which one depends on the
    transformers version reading it (5.17 reads `<|endoftext|>`, so `generate` ran past the
    end of the turn), while `regenerate` stops at the template's end of turn."""
    return sorted({tok.eos_token_id, tok.convert_tokens_to_ids("<|im_end|>")})
