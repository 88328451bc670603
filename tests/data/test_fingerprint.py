"""Tokenizer fingerprints tell real tokenizers apart by what their ids mean."""

from __future__ import annotations

from transformers import AutoTokenizer

from eagle3kit.data.fingerprint import tokenizer_fingerprint
from tests import assets
from tests.data import chat_tokenizers


def test_one_renamed_token_string_changes_the_key(tmp_path):
    """SmolLM2's real tokenizer and the same with one special token renamed: equal vocab
    sizes and ids, different keys (a digest over the ids alone would call them equal)."""
    source = chat_tokenizers.saved("smollm2")
    original = AutoTokenizer.from_pretrained(source)
    twin = AutoTokenizer.from_pretrained(assets.with_renamed_token(source, tmp_path / "twin"))
    assert len(twin) == len(original)
    a, b = original.get_vocab(), twin.get_vocab()
    assert sorted(a.values()) == sorted(b.values()) and len(set(a) ^ set(b)) == 2
    assert tokenizer_fingerprint(twin, "x").key != tokenizer_fingerprint(original, "x").key
    again = AutoTokenizer.from_pretrained(source)
    assert tokenizer_fingerprint(again, "y").key == tokenizer_fingerprint(original, "x").key
