"""Real tokenizers with the public chat templates of three model families, built offline.

- ChatML: SmolLM2-135M-Instruct's own tokenizer and template, read from the real GGUF.
- Llama-3: the chat template of meta-llama/Llama-3.1-8B-Instruct (tokenizer_config.json,
  as published with the model; templates/llama-3.1-8b-instruct.jinja), with its special
  tokens (<|begin_of_text|>, <|start_header_id|>, <|end_header_id|>, <|eot_id|>, ...) added.
- Qwen3: the chat template of Qwen/Qwen3-8B (revision 895c8d1, whose assistant branch reads
  `reasoning_content is string` and whose generation prompt honours `enable_thinking`;
  templates/qwen3-8b.jinja), with <think>, </think> and the tool tokens added as ordinary
  (non-special) added tokens, as in Qwen3's tokenizer.

The Llama and Qwen vocabularies are SmolLM2's byte-level BPE plus those tokens: Hub downloads
are impossible here, and what the tests check (where the template puts each turn, which
tokens the mask covers) depends on the template and the special tokens, not on the merges.
"""

from __future__ import annotations

import functools
import tempfile
from pathlib import Path

from tests import assets

TEMPLATES = Path(__file__).parent / "templates"


@functools.lru_cache(maxsize=1)
def _smollm2_dir() -> Path:
    """SmolLM2's tokenizer saved as a transformers directory (loads in ~0.1 s, not 8 s)."""
    d = Path(tempfile.mkdtemp(prefix="eagle3kit-smollm2-tok-"))
    assets.smollm2_tokenizer().save_pretrained(d)
    return d


def _fresh():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(_smollm2_dir())


def smollm2():
    return assets.smollm2_tokenizer()


@functools.lru_cache(maxsize=1)
def llama3():
    tok = _fresh()
    tok.add_special_tokens({
        "bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>",
        "additional_special_tokens": ["<|end_of_text|>", "<|start_header_id|>",
                                      "<|end_header_id|>", "<|eom_id|>", "<|python_tag|>"]})
    tok.chat_template = (TEMPLATES / "llama-3.1-8b-instruct.jinja").read_text()
    return tok


@functools.lru_cache(maxsize=1)
def qwen3():
    tok = _fresh()
    tok.add_tokens(["<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>",
                    "</tool_response>"])
    tok.chat_template = (TEMPLATES / "qwen3-8b.jinja").read_text()
    return tok


@functools.lru_cache(maxsize=1)
def gemma3():
    """Gemma-3's template (google/gemma-3-27b-it) and its turn and bos tokens."""
    tok = _fresh()
    tok.add_special_tokens({"bos_token": "<bos>", "eos_token": "<eos>",
                            "additional_special_tokens": ["<start_of_turn>", "<end_of_turn>"]})
    tok.chat_template = (TEMPLATES / "gemma-3-it.jinja").read_text()
    return tok


@functools.lru_cache(maxsize=1)
def gpt_oss():
    """gpt-oss's harmony template (openai/gpt-oss-20b, tools removed) and its special tokens;
    `<|return|>` ends the last assistant turn as eos, as in the published tokenizer."""
    tok = _fresh()
    tok.add_special_tokens({
        "bos_token": "<|startoftext|>", "eos_token": "<|return|>",
        "additional_special_tokens": ["<|start|>", "<|end|>", "<|message|>", "<|channel|>",
                                      "<|constrain|>", "<|call|>", "<|endoftext|>"]})
    tok.chat_template = (TEMPLATES / "gpt-oss-20b.jinja").read_text()
    return tok


FAMILIES = {"smollm2": smollm2, "llama3": llama3, "qwen3": qwen3, "gemma3": gemma3,
            "gpt_oss": gpt_oss}


@functools.lru_cache(maxsize=8)
def saved(name: str) -> Path:
    """The tokenizer `name` (a key of FAMILIES) as a directory, for CLI tests."""
    tok = FAMILIES[name]()
    if name == "smollm2":
        return _smollm2_dir()
    d = Path(tempfile.mkdtemp(prefix=f"eagle3kit-{name}-tok-"))
    tok.save_pretrained(d)
    return d


END_OF_TURN = {"smollm2": "<|im_end|>", "llama3": "<|eot_id|>", "qwen3": "<|im_end|>",
               "gemma3": "<end_of_turn>"}
