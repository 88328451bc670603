"""Packing token records into fixed [rows, T] batches, so the train step compiles once.

Why packing rather than bucketing: chat conversations vary from a few dozen to thousands of
tokens; padding each to T wastes most of the compute on short ones, and buckets would compile
one step per bucket. Packing several documents per row keeps one static shape and fills
~95% of the tokens; segment ids keep documents apart (attention never crosses them, and the
TTT targets stop at each document's end), and positions restart at 0 in each document.

The packing of an epoch depends only on the seed, the epoch and the records, so a resumed
run rebuilds exactly the same batches and skips to its saved position.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

# A document is placed into the first of the last WINDOW open rows where it fits.
WINDOW = 64


@dataclasses.dataclass
class TokenDocs:
    """Documents in memory: ids and loss masks, as int32 / int8 arrays."""

    ids: list[np.ndarray]
    masks: list[np.ndarray]
    truncated: int = 0  # kept documents cut to seq_len
    dropped: int = 0  # records with no assistant token in their first seq_len tokens

    @classmethod
    def from_records(cls, records, seq_len: int) -> TokenDocs:
        """Documents cut to `seq_len`; records left with nothing to learn are counted apart,
        so read = len(docs) + dropped, and truncated <= len(docs)."""
        ids, masks, truncated, dropped = [], [], 0, 0
        for r in records:
            n = min(len(r.input_ids), seq_len)
            mask = np.asarray(r.loss_mask[:n], np.int8)
            if n < 2 or not mask.any():
                dropped += 1
                continue
            truncated += len(r.input_ids) > seq_len
            ids.append(np.asarray(r.input_ids[:n], np.int32))
            masks.append(mask)
        return cls(ids, masks, truncated, dropped)

    def __len__(self) -> int:
        return len(self.ids)

    @property
    def num_tokens(self) -> int:
        return int(sum(len(x) for x in self.ids))

    def shard(self, index: int, count: int) -> TokenDocs:
        """Documents index, index+count, ...: one process's share on a multi-host run."""
        return TokenDocs(self.ids[index::count], self.masks[index::count], self.truncated,
                         self.dropped)


def pack_rows(lengths: Sequence[int], seq_len: int, seed: int) -> list[list[int]]:
    """Shuffles documents with `seed`, then first-fit within a window of open rows."""
    order = np.random.default_rng(seed).permutation(len(lengths))
    rows: list[list[int]] = []
    free: list[int] = []
    for i in order:
        n = int(lengths[i])
        start = max(0, len(rows) - WINDOW)
        for r in range(start, len(rows)):
            if free[r] >= n:
                rows[r].append(int(i))
                free[r] -= n
                break
        else:
            rows.append([int(i)])
            free.append(seq_len - n)
    return rows


@dataclasses.dataclass
class Packed:
    """One epoch's rows for one process."""

    docs: TokenDocs
    rows: list[list[int]]
    seq_len: int

    def batch(self, start: int, count: int) -> dict[str, np.ndarray]:
        """Rows start..start+count as arrays [count, T]; past the end, empty padding rows."""
        shape = (count, self.seq_len)
        out = {"tokens": np.zeros(shape, np.int32), "loss_mask": np.zeros(shape, np.int32),
               "segment_ids": np.zeros(shape, np.int32), "positions": np.zeros(shape, np.int32)}
        for j in range(count):
            if start + j >= len(self.rows):
                break
            t = 0
            for seg, d in enumerate(self.rows[start + j], start=1):
                ids, mask = self.docs.ids[d], self.docs.masks[d]
                n = len(ids)
                out["tokens"][j, t:t + n] = ids
                out["loss_mask"][j, t:t + n] = mask
                out["segment_ids"][j, t:t + n] = seg
                out["positions"][j, t:t + n] = np.arange(n)
                t += n
        return out

    @property
    def fill(self) -> float:
        used = sum(len(self.docs.ids[d]) for row in self.rows for d in row)
        return used / max(len(self.rows) * self.seq_len, 1)


def pack_epoch(docs: TokenDocs, seq_len: int, seed: int, epoch: int) -> Packed:
    lengths = [len(x) for x in docs.ids]
    return Packed(docs, pack_rows(lengths, seq_len, seed * 1_000_003 + epoch), seq_len)
