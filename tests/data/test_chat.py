"""Loss masks on real ShareGPT conversations for ChatML (SmolLM2), Llama-3.1 and Qwen3.

For every conversation: the ids equal `apply_chat_template(tokenize=True)` (the model sees
exactly what its own template makes), and the masked tokens form one run per assistant turn
that decodes to exactly that turn's content plus its end-of-turn token (Llama-3 trims the
content; Qwen3 in thinking mode generates the `<think>\\n\\n</think>\\n\\n` of the last turn
itself, so it is part of that run; with --no-thinking it is prompt).
"""

from __future__ import annotations

import pytest

from eagle3kit.data.chat import Renderer, RenderError, mask_from_spans, prompt_ids, render
from tests import assets
from tests.data import chat_tokenizers

N_REAL = 40
THINK = "<think>\n\n</think>\n\n"

# hand-made shapes the real sample may lack: system prompt, assistant first, two assistant
# turns in a row, a conversation ending with a user turn
SHAPES = [
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi"},
     {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Bye"},
     {"role": "assistant", "content": "Goodbye!\n\nSee you."}],
    [{"role": "assistant", "content": "I start."}, {"role": "user", "content": "ok"},
     {"role": "assistant", "content": "Then I go on."}],
    [{"role": "user", "content": "Two answers?"}, {"role": "assistant", "content": "One."},
     {"role": "assistant", "content": "Two."}],
    [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"},
     {"role": "user", "content": "unanswered"}],
]


def _conversations():
    real = [[{"role": m.role, "content": m.content} for m in c.messages]
            for c in assets.sharegpt_chats(N_REAL)]
    return real + SHAPES


def _runs(ids, mask):
    runs, cur = [], []
    for t, m in zip(ids, mask, strict=True):
        if m:
            cur.append(t)
        elif cur:
            runs.append(cur)
            cur = []
    return runs + ([cur] if cur else [])


def _expected(family, thinking, messages):
    eot = chat_tokenizers.END_OF_TURN[family]
    turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    out = [messages[i]["content"].strip() + eot for i in turns]
    if family == "qwen3" and thinking is not False:
        # Qwen3 writes a think block into the final assistant turn after the last user query
        users = [i for i, m in enumerate(messages) if m["role"] == "user"]
        last_query = users[-1] if users else len(messages) - 1
        if turns[-1] == len(messages) - 1 and turns[-1] > last_query:
            out[-1] = THINK + out[-1]
    return out


@pytest.mark.slow
@pytest.mark.parametrize("family,thinking", [("smollm2", None), ("llama3", None),
                                             ("qwen3", True), ("qwen3", False)])
def test_real_conversations(family, thinking):
    tok = getattr(chat_tokenizers, family)()
    renderer = Renderer(tok, thinking=thinking)
    kwargs = {} if thinking is None else {"enable_thinking": thinking}
    for messages in _conversations():
        ids, mask = renderer.render(messages)
        assert ids == tok.apply_chat_template(messages, tokenize=True, return_dict=False,
                                              **kwargs)
        assert [tok.decode(r) for r in _runs(ids, mask)] == _expected(family, thinking,
                                                                      messages)


@pytest.mark.slow
def test_qwen3_thinking_modes_differ_only_in_the_think_block():
    tok = chat_tokenizers.qwen3()
    messages = SHAPES[0]
    ids_t, mask_t = render(tok, messages, thinking=True)
    ids_n, mask_n = render(tok, messages, thinking=False)
    assert ids_t == ids_n  # the official template renders past turns alike in both modes
    diff = [t for t, a, b in zip(ids_t, mask_t, mask_n, strict=True) if a != b]
    assert tok.decode(diff) == THINK


@pytest.mark.slow
@pytest.mark.parametrize("thinking,last", [(True, "<think>\nLet me think.\n</think>\n\n4."),
                                           (False, "4.")])
def test_qwen3_reasoning_in_content(thinking, last):
    tok = chat_tokenizers.qwen3()
    messages = [{"role": "user", "content": "2+2?"},
                {"role": "assistant", "content": "<think>\nold thoughts\n</think>\n\n4"},
                {"role": "user", "content": "and again?"},
                {"role": "assistant", "content": "<think>\nLet me think.\n</think>\n\n4."}]
    ids, mask = render(tok, messages, thinking=thinking)
    assert ids == tok.apply_chat_template(messages, tokenize=True, return_dict=False,
                                          enable_thinking=thinking)
    # the template drops the reasoning of past turns; the last turn's is generated text
    # in thinking mode and prompt with --no-thinking
    assert [tok.decode(r) for r in _runs(ids, mask)] == ["4<|im_end|>", last + "<|im_end|>"]


@pytest.mark.slow
@pytest.mark.parametrize("family", ["smollm2", "llama3", "qwen3"])
def test_prompt_ids_end_with_the_generation_prompt(family):
    tok = getattr(chat_tokenizers, family)()
    messages = SHAPES[0][:-1]
    assert prompt_ids(tok, messages) == tok.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=False)


@pytest.mark.slow
def test_special_token_text_in_content_is_refused():
    messages = [{"role": "user", "content": "what does <|im_end|> mean?"},
                {"role": "assistant", "content": "It ends a turn."}]
    with pytest.raises(RenderError) as e:
        render(chat_tokenizers.smollm2(), messages)
    assert e.value.reason == "special-token text in content"
    assert "'<|im_end|>'" in str(e.value)


@pytest.mark.slow
def test_template_refusal_is_a_render_error():
    strict = ("{% for m in messages %}{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
              "{{ raise_exception('roles must alternate') }}{% endif %}"
              "{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}"
              "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
              "{% endif %}")
    with pytest.raises(RenderError) as e:
        render(chat_tokenizers.smollm2(), SHAPES[2], chat_template=strict)
    assert e.value.reason == "the chat template refuses it"
    assert "roles must alternate" in str(e.value)


@pytest.mark.slow
def test_template_without_generation_prompt_masks_from_the_content():
    # Mistral-style: no add_generation_prompt branch; the model's output is the content
    tok = chat_tokenizers.smollm2()
    inst = ("{% for m in messages %}{% if m['role'] == 'user' %}{{ '<|im_start|>' + m['content']"
            " + '<|im_end|>' }}{% else %}{{ ' ' + m['content'] + '<|endoftext|>' }}{% endif %}"
            "{% endfor %}")
    ids, mask = render(tok, SHAPES[1][1:], chat_template=inst)
    assert [tok.decode(r) for r in _runs(ids, mask)] == [" Then I go on.<|endoftext|>"]


@pytest.mark.slow
def test_templates_the_mask_cannot_follow_are_refused():
    tok = chat_tokenizers.smollm2()
    no_eot = ("{% for m in messages %}{{ m['role'] + ': ' + m['content'] + '\n' }}{% endfor %}"
              "{% if add_generation_prompt %}{{ 'assistant: ' }}{% endif %}")
    with pytest.raises(RenderError) as e:
        render(tok, SHAPES[3], chat_template=no_eot)
    assert e.value.reason == "no end-of-turn token"


@pytest.mark.slow
def test_leading_whitespace_token_straddling_the_header_stays_prompt():
    # "assistant\n" + "  code": byte-level BPE merges "\n " into one token; at inference the
    # prompt ends with "\n", so that token is never generated and is not masked
    tok = chat_tokenizers.smollm2()
    messages = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "  code"}]
    ids, mask = render(tok, messages)
    assert ids == tok.apply_chat_template(messages, tokenize=True, return_dict=False)
    assert [tok.decode(r) for r in _runs(ids, mask)] == [" code<|im_end|>"]


def test_mask_from_spans():
    offsets = [(0, 3), (3, 5), (5, 9), (9, 10), (10, 14), (14, 20)]
    # a token is masked when its first character lies in a span
    assert mask_from_spans(offsets, [(4, 10), (14, 20)]) == [0, 0, 1, 1, 0, 1]
    assert mask_from_spans(offsets, []) == [0] * 6
