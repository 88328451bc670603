"""`vocab-select`: count loss-masked tokens and choose the draft vocabulary.

Only tokens with loss_mask 1 count (what the draft must predict: assistant content and its
end-of-turn token), per the EAGLE3 recipe. The choice itself (top Vd by (-count, id), filled
with the lowest unused ids when fewer occur, d2t/t2d) is `core.vocab.VocabMap.from_counts`.
"""

from __future__ import annotations

import dataclasses
import os

import numpy as np

from eagle3kit.core.vocab import VocabMap
from eagle3kit.data.fingerprint import Fingerprint, parse_key, require_same
from eagle3kit.data.records import decode_token, display_name, iter_lines
from eagle3kit.errors import InputError

_FLUSH = 1 << 20  # masked ids buffered before one bincount


@dataclasses.dataclass
class TokenCounts:
    """Masked-token counts [V] of a token-record file and where they came from."""

    counts: np.ndarray  # int64 [V]
    key: str  # the records' tokenizer fingerprint key
    records: int

    @property
    def masked(self) -> int:
        return int(self.counts.sum())


def count_masked(path: str | os.PathLike, expected_key: str | None = None) -> TokenCounts:
    """Counts the loss-masked token ids of a token-record file (`-` = stdin).

    Every record must carry the same tokenizer key (and `expected_key`, when given); an id
    outside that tokenizer's vocab is an error naming the line.
    """
    where = display_name(path)
    key, vocab_size, counts = expected_key, 0, None
    pending: list[np.ndarray] = []
    buffered, records = 0, 0
    for number, line in iter_lines(path):
        r = decode_token(line, where, number)
        if key is None:
            key = r.tokenizer
        if r.tokenizer != key:
            what = f"line {number} (record {r.id!r})"
            require_same(key, r.tokenizer, what, where,
                         "the --tokenizer given" if expected_key else
                         "the first record's tokenizer")
        if counts is None:
            vocab_size, _ = parse_key(key, where)
            counts = np.zeros(vocab_size, np.int64)
        ids = np.asarray(r.input_ids, np.int64)[np.asarray(r.loss_mask, np.bool_)]
        if ids.size and int(ids.max()) >= vocab_size:
            raise InputError(f"record {r.id!r} has token id {int(ids.max())}, outside the "
                             f"tokenizer's vocab of {vocab_size}", path=where, line=number)
        pending.append(ids)
        buffered += ids.size
        records += 1
        if buffered >= _FLUSH:
            counts += np.bincount(np.concatenate(pending), minlength=vocab_size)
            pending, buffered = [], 0
    if counts is None:
        raise InputError("no token records (empty input)", path=where)
    if pending:
        counts += np.bincount(np.concatenate(pending), minlength=vocab_size)
    return TokenCounts(counts, key, records)


@dataclasses.dataclass
class Selection:
    vocab: VocabMap
    filled: int  # ids added because fewer than Vd distinct tokens occur
    coverage: float  # share of masked tokens whose id is in the draft vocab
    masked: int

    def metadata(self, fingerprint: Fingerprint) -> dict[str, str]:
        """The vocab file's metadata (safetensors string values)."""
        return {"tokenizer": fingerprint.to_json(),
                "draft_vocab_size": str(self.vocab.draft_size),
                "target_vocab_size": str(self.vocab.target_size),
                "coverage": f"{self.coverage:.6f}", "filled": str(self.filled),
                "masked_tokens": str(self.masked)}


def select(counts: TokenCounts, size: int) -> Selection:
    """The `size` most frequent masked tokens as a d2t/t2d map."""
    if counts.masked == 0:
        raise InputError("no loss-masked tokens in the data (nothing for the draft to learn)")
    if size <= 0:
        raise InputError(f"--size must be positive, got {size}")
    if size > len(counts.counts):
        raise InputError(f"--size {size:,} exceeds the target vocab of {len(counts.counts):,} "
                         "tokens")
    vocab, filled = VocabMap.from_counts(counts.counts, size)
    covered = int(counts.counts[vocab.used_ids].sum())
    return Selection(vocab, filled, covered / counts.masked, counts.masked)
