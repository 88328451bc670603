"""A Gemma GGUF tokenizer made by the test (21 tokens, written with the `gguf` package), fast:
its merges follow the order of the tokens in the file, both as transformers builds it and as
eagle3kit builds it for the transformers versions whose own build is wrong; and the known
`gemma` chat template renders a multi-turn conversation with a system prompt as Gemma's
published template does. (The real Gemma-3 tokenizer and template: the slow tests of
test_tokenizer.py.)"""

from __future__ import annotations

import sys

import gguf
import pytest

from eagle3kit.data.chat import Renderer
from eagle3kit.data.tokenizer import load_chat_template, load_tokenizer
from tests.data.chat_tokenizers import TEMPLATES

# Gemma's special tokens first (its ids 0-4), then characters, then merged tokens in merge order: `wo`
# before `ld` before `or` before `rl` ... A BPE that applies the best-ranked merge first
# makes "world" one token; one that ranks them in reverse (the later token first) cuts it
# into `wo`, `rl`, `d`. The scores are all 0: Gemma's files carry scores that do not follow
# the merge order.
TOKENS = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "<start_of_turn>", "<end_of_turn>",
          "\u2581", "w", "o", "r", "l", "d", "\n", "wo", "ld", "or", "rl", "wor", "world",
          "\u2581world"]
CONTROL, NORMAL = 3, 1  # GGUF token types
# "world world wor" split as the file's merge order says (`\u2581wor` is no token)
EXPECTED = ["<bos>", "world", "\u2581world", "\u2581", "wor"]


@pytest.fixture(scope="module")
def gemma_gguf(tmp_path_factory):
    path = tmp_path_factory.mktemp("gemma-tok") / "tiny-gemma.gguf"
    w = gguf.GGUFWriter(path, "gemma3")
    w.add_tokenizer_model("llama")  # sentencepiece
    w.add_token_list(TOKENS)
    w.add_token_scores([0.0] * len(TOKENS))
    types = [CONTROL] * 7 + [NORMAL] * (len(TOKENS) - 7)
    types[3] = 2  # <unk>: UNKNOWN
    w.add_token_types(types)
    w.add_pad_token_id(0)
    w.add_eos_token_id(1)
    w.add_bos_token_id(2)
    w.add_unk_token_id(3)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _pre_5_18(monkeypatch):
    """This process as under transformers before 5.18, which lacks the GGUF tokenizer
    converter (load_tokenizer then builds a Gemma tokenizer itself)."""
    monkeypatch.setitem(sys.modules,
                        "transformers.integrations.gguf.gguf_tokenizer_mapping", None)


@pytest.mark.parametrize("transformers", ["current", "before 5.18"])
def test_merges_follow_the_order_of_the_tokens_in_the_file(gemma_gguf, monkeypatch,
                                                           transformers):
    if transformers != "current":
        _pre_5_18(monkeypatch)
    tok = load_tokenizer(str(gemma_gguf))
    ids = tok("world world wor").input_ids
    assert tok.convert_ids_to_tokens(ids) == EXPECTED
    assert tok.decode(ids, skip_special_tokens=True) == "world world wor"
    assert (tok.bos_token, tok.eos_token, len(tok)) == ("<bos>", "<eos>", len(TOKENS))
    # the turn markers are single special tokens, as in Gemma's own tokenizer
    assert tok("<start_of_turn>wo<end_of_turn>", add_special_tokens=False).input_ids == [5, 14, 6]


MESSAGES = [{"role": "system", "content": "Be brief."},
            {"role": "user", "content": "world"},
            {"role": "assistant", "content": "wor"},
            {"role": "user", "content": " wo "},
            {"role": "assistant", "content": "ld"},
            {"role": "user", "content": "rl"}]
# Gemma's rendering: the system prompt opens the first user turn only; contents trimmed
REFERENCE = ("<bos><start_of_turn>user\nBe brief.\n\nworld<end_of_turn>\n"
             "<start_of_turn>model\nwor<end_of_turn>\n"
             "<start_of_turn>user\nwo<end_of_turn>\n"
             "<start_of_turn>model\nld<end_of_turn>\n"
             "<start_of_turn>user\nrl<end_of_turn>\n")


def test_known_gemma_template_puts_the_system_prompt_in_the_first_turn_only(gemma_gguf):
    """`--chat-template gemma` (base Gemma models carry no template) on a three-turn
    conversation with a system prompt: the text is Gemma's published template's, with and
    without the generation prompt, and so are the ids eagle3kit trains on."""
    tok = load_tokenizer(str(gemma_gguf))
    published = (TEMPLATES / "gemma-3-it.jinja").read_text()
    renderer = Renderer(tok, chat_template=load_chat_template("gemma"))
    for prompt, tail in ((False, ""), (True, "<start_of_turn>model\n")):
        assert renderer.text(MESSAGES, add_generation_prompt=prompt) == REFERENCE + tail
        assert tok.apply_chat_template(MESSAGES, chat_template=published, tokenize=False,
                                       add_generation_prompt=prompt) == REFERENCE + tail
    ids, mask = renderer.render(MESSAGES[:-1])
    assert ids == tok.apply_chat_template(MESSAGES[:-1], chat_template=published,
                                          tokenize=True, return_dict=False)
    assert tok.decode([i for i, m in zip(ids, mask, strict=True) if m]) == \
        "wor<end_of_turn>ld<end_of_turn>"
