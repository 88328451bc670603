"""Tokenizer fingerprints: every artifact says which tokenizer made its token ids.

A fingerprint is the tokenizer's name, vocab size, a digest of its vocabulary (what token
ids mean) and a digest of the chat template used to render the data.
Token records carry the compact `key` (vocab size and vocabulary digest); vocab files, runs
and drafts carry the whole fingerprint. Every command that combines two artifacts refuses a
mismatch of `key` before doing any work: ids from another tokenizer would train garbage.
The template digest is recorded for provenance; a custom `--chat-template` changes the data,
not the meaning of its ids, so it is not a mismatch.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import msgspec

from eagle3kit.errors import InputError, MismatchError


class Fingerprint(msgspec.Struct, frozen=True, forbid_unknown_fields=False):
    name: str
    vocab_size: int
    digest: str  # 16 hex digits of sha256 over the vocabulary (token -> id)
    template: str = ""  # 16 hex digits of sha256 over the chat template used

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
    # The vocabulary alone (added and special tokens included): what the ids mean. Lists such
    # as `all_special_tokens` differ between transformers versions for one tokenizer.
    h = hashlib.sha256()
    h.update(json.dumps(vocab, ensure_ascii=False).encode())
    return Fingerprint(name=name, vocab_size=len(tokenizer), digest=h.hexdigest()[:16],
                       template=hashlib.sha256(template.encode()).hexdigest()[:16])


RETOKENIZE = "re-tokenize the data (and re-run vocab-select) with the target's tokenizer"


def require_same(expected: str, actual: str, what: str, where: object,
                 expected_from: str = "the target tokenizer", fix: str = RETOKENIZE) -> None:
    """Raises a MismatchError unless two fingerprint keys agree; `fix` says what to redo
    (the artifact named by `what` is the one blamed)."""
    if expected != actual:
        raise MismatchError(
            f"{what} was made with tokenizer {actual}, but {expected_from} is {expected}; "
            f"{fix}", path=where)


def parse_key(key: str, where: object = None) -> tuple[int, str]:
    """`<vocab size>:<digest>` -> (vocab size, digest); anything else is an InputError."""
    size, sep, digest = str(key).partition(":")
    if not (sep and size.isdigit() and int(size) > 0 and len(digest) == 16
            and all(c in "0123456789abcdef" for c in digest)):
        raise InputError(f"malformed tokenizer fingerprint {key!r} (expected "
                         "<vocab size>:<16 hex digits>)", path=where)
    return int(size), digest
