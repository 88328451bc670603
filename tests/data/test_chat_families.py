"""Loss masks for Gemma-3 and gpt-oss (harmony) templates, as test_chat.py does for the others,
and a fast check of the hand-made shapes in every family and mode.

For every conversation the templates accept: the ids equal `apply_chat_template(tokenize=True)`,
and the masked tokens form one run per assistant turn that decodes to exactly what the model
generates after its generation prompt. Gemma: the trimmed content and `<end_of_turn>`.
gpt-oss: after `<|start|>assistant` the model writes the channel header, the content and
`<|end|>`, or `<|return|>` for the last turn (the token that ends generation when served).
Gemma's template refuses non-alternating roles; those conversations are a RenderError.
"""

from __future__ import annotations

import pytest

from eagle3kit.data.chat import Renderer, RenderError, prompt_ids
from tests.data import chat_tokenizers
from tests.data.test_chat import SHAPES, _conversations, _runs
from tests.data.test_chat import _expected as _expected_chatml_llama_qwen

FINAL = "<|channel|>final<|message|>"


def _expected(family, messages):
    turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    if family == "gemma3":
        return [messages[i]["content"].strip() + "<end_of_turn>" for i in turns]
    return [FINAL + messages[i]["content"] + ("<|return|>" if i == len(messages) - 1
                                              else "<|end|>") for i in turns]


def _alternates(messages):
    roles = [m["role"] for m in messages if m["role"] != "system"]
    return all(r == ("user" if k % 2 == 0 else "assistant") for k, r in enumerate(roles))


@pytest.mark.slow
@pytest.mark.parametrize("family", ["gemma3", "gpt_oss"])
def test_real_conversations(family):
    tok = getattr(chat_tokenizers, family)()
    renderer = Renderer(tok)
    checked = 0
    for messages in _conversations():
        if family == "gemma3" and not _alternates(messages):
            with pytest.raises(RenderError, match="must alternate"):
                renderer.render(messages)
            continue
        ids, mask = renderer.render(messages)
        assert ids == tok.apply_chat_template(messages, tokenize=True, return_dict=False)
        assert [tok.decode(r) for r in _runs(ids, mask)] == _expected(family, messages)
        checked += 1
    assert checked >= 25  # ShareGPT has non-alternating ones


@pytest.mark.parametrize("family", ["gemma3", "gpt_oss"])
def test_prompt_ids_end_with_the_generation_prompt(family):
    tok = getattr(chat_tokenizers, family)()
    messages = SHAPES[0][:-1]
    ids = prompt_ids(tok, messages)
    assert ids == tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                          return_dict=False)
    assert tok.decode(ids).endswith({"gemma3": "<start_of_turn>model\n",
                                     "gpt_oss": "<|start|>assistant"}[family])


MODES = [("smollm2", None), ("llama3", None), ("qwen3", True), ("qwen3", False),
         ("gemma3", None), ("gpt_oss", None)]


@pytest.mark.parametrize("family,thinking", MODES)
def test_every_family_masks_what_the_model_generates_and_nothing_else(family, thinking):
    """The hand-made shapes (a system prompt, an assistant first, two assistant turns in a
    row, a last user turn left unanswered) in every supported family and mode, fast: the ids
    are `apply_chat_template`'s, and the masked runs are exactly the generated text of each
    assistant turn: from right after the generation prompt (which is prompt, never masked) to
    the end-of-turn token that closes the turn (which the draft must learn to emit)."""
    tok = chat_tokenizers.FAMILIES[family]()
    renderer = Renderer(tok, thinking=thinking)
    kwargs = {} if thinking is None else {"enable_thinking": thinking}
    checked = 0
    for messages in SHAPES:
        if family == "gemma3" and not _alternates(messages):
            continue  # refused by the template (test_real_conversations)
        ids, mask = renderer.render(messages)
        assert ids == tok.apply_chat_template(messages, tokenize=True, return_dict=False,
                                              **kwargs)
        expected = (_expected(family, messages) if family in ("gemma3", "gpt_oss")
                    else _expected_chatml_llama_qwen(family, thinking, messages))
        assert [tok.decode(r) for r in _runs(ids, mask)] == expected, messages
        checked += 1
    assert checked >= 2
