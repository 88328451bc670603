"""The draft vocabulary: the Vd most frequent target tokens and the d2t / t2d mapping.

`d2t[i] = used[i] - i` (int64 offsets, so draft id i is target id i + d2t[i]) and
`t2d[v] = v in used` (bool over the target vocab), with `used` sorted ascending: exactly the
tensors SGLang, vLLM and speculators read.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from eagle3kit.errors import InputError


@dataclasses.dataclass(frozen=True)
class VocabMap:
    d2t: np.ndarray  # int64 [Vd]
    t2d: np.ndarray  # bool [V]

    def __post_init__(self):
        used = self.used_ids
        if self.d2t.dtype != np.int64 or self.t2d.dtype != np.bool_:
            raise InputError(f"d2t must be int64 and t2d bool (got {self.d2t.dtype}, "
                             f"{self.t2d.dtype})")
        if len(used) and (np.any(np.diff(used) <= 0) or used[0] < 0 or
                          used[-1] >= len(self.t2d)):
            raise InputError("d2t is not a valid offset table (ids must be strictly "
                             "increasing and inside the target vocab; absolute ids?)")
        if not np.array_equal(np.flatnonzero(self.t2d), used):
            raise InputError("d2t and t2d disagree: arange(Vd) + d2t must equal where(t2d)")

    @property
    def draft_size(self) -> int:
        return len(self.d2t)

    @property
    def target_size(self) -> int:
        return len(self.t2d)

    @property
    def used_ids(self) -> np.ndarray:
        """Target ids of the draft tokens, ascending [Vd]."""
        return np.arange(len(self.d2t), dtype=np.int64) + self.d2t

    @classmethod
    def from_ids(cls, used: np.ndarray, target_size: int) -> VocabMap:
        used = np.sort(np.asarray(used, np.int64))
        t2d = np.zeros(target_size, np.bool_)
        t2d[used] = True
        return cls(used - np.arange(len(used), dtype=np.int64), t2d)

    @classmethod
    def from_counts(cls, counts: np.ndarray, size: int) -> tuple[VocabMap, int]:
        """Top `size` ids by (-count, id); when fewer occur, fill with the lowest unused ids.

        Returns the map and how many ids were filled in.
        """
        counts = np.asarray(counts, np.int64)
        if size > len(counts):
            raise InputError(f"draft vocab size {size} exceeds the target vocab {len(counts)}")
        order = np.lexsort((np.arange(len(counts)), -counts))  # by -count, then by id
        seen = int(np.count_nonzero(counts))
        top = order[: min(size, seen)]
        filled = size - len(top)
        if filled:
            unused = np.flatnonzero(counts == 0)[:filled]
            top = np.concatenate([top, unused])
        return cls.from_ids(top, len(counts)), filled

    @classmethod
    def identity(cls, target_size: int) -> VocabMap:
        return cls(np.zeros(target_size, np.int64), np.ones(target_size, np.bool_))
