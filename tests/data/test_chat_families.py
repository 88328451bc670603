"""Loss masks for Gemma-3 and gpt-oss (harmony) templates, as test_chat.py does for the others.

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
