"""Tokenizer fingerprints: every artifact says which tokenizer made its token ids.

A fingerprint is the tokenizer's name, vocab size and a digest of its vocabulary, special
tokens and chat template. Token records, vocab files, runs and drafts carry it, and every
command that combines two artifacts refuses a mismatch before doing any work.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import msgspec

from eagle3kit.errors import MismatchError


class Fingerprint(msgspec.Struct, frozen=True, forbid_unknown_fields=False):
    name: str
    vocab_size: int
    digest: str  # 16 hex digits of sha256

    @property
    def key(self) -> str:
        """Compact form carried by every token record: `<vocab size>:<digest>`."""
        return f"{self.vocab_size}:{self.digest}"

    def to_json(self) -> str:
        return msgspec.json.encode(self).decode()

    @classmethod
    def from_json(cls, text: str) -> Fingerprint:
        return msgspec.json.decode(text, type=cls)


def tokenizer_fingerprint(tokenizer: Any, name: str, chat_template: str | None = None
                          ) -> Fingerprint:
    """Fingerprint of a transformers tokenizer (and the chat template actually used)."""
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1])
    template = chat_template if chat_template is not None else (tokenizer.chat_template or "")
    if isinstance(template, dict):
        template = json.dumps(template, sort_keys=True)
    special = sorted(str(t) for t in tokenizer.all_special_tokens)
    h = hashlib.sha256()
    h.update(json.dumps(vocab, ensure_ascii=False).encode())
    h.update(b"\0" + "\n".join(special).encode())
    h.update(b"\0" + template.encode())
    return Fingerprint(name=name, vocab_size=len(tokenizer), digest=h.hexdigest()[:16])


def require_same(expected: str, actual: str, what: str, where: object,
                 expected_from: str = "the target tokenizer") -> None:
    """Raises a MismatchError unless two fingerprint keys agree."""
    if expected != actual:
        raise MismatchError(
            f"{what} was made with tokenizer {actual}, but {expected_from} is {expected}; "
            "re-tokenize the data (and re-run vocab-select) with the target's tokenizer",
            path=where)
