"""Degenerate repetition: an answer whose last tokens are copies of one block.

Small targets decoded greedily fall into loops: SmolLM2-135M repeats a sentence until the token
limit (62% of its regenerated ShareGPT answers ran to a 768-token cap, docs/benchmarks.md). A
loop is caught where the engine's tokens come back to the host (after each decode program)
and the answer is ended at the token that completed it, so little compute goes into loops and
the answer does not depend on how often the host syncs.

The rule (`Repetition`): the answer's last tokens are `copies` back-to-back copies of a block
of p tokens (1 <= p <= `max_block`) that together span at least `min_tokens` tokens; a short
block needs more copies (p = 1: `min_tokens` equal tokens in a row). `Repetition.tail` states
it on one token list; `Detector` applies it to many rows at once, token by token, with a few
array operations per decoding step (a run length per row and block length).

Shapes: C rows, P = max_block, K tokens per row in one sync.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np


@dataclasses.dataclass(frozen=True)
class Repetition:
    copies: int = 3  # back-to-back copies of one block
    min_tokens: int = 64  # the copies span at least this many tokens
    max_block: int = 128  # longest block looked for

    def __post_init__(self):
        if self.copies < 2 or self.min_tokens < 1 or self.max_block < 1:
            raise ValueError(f"{self}: needs copies >= 2, min_tokens >= 1, max_block >= 1")

    def span(self, block: int) -> int:
        """Tokens the copies of a `block`-token block must cover."""
        return max(self.copies * block, self.min_tokens)

    def tail(self, tokens: Sequence[int]) -> int | None:
        """The shortest block the end of `tokens` repeats by the rule, or None."""
        n = len(tokens)
        for p in range(1, self.max_block + 1):
            span = self.span(p)
            if span > n:
                continue
            end = tokens[n - span:]
            if all(end[j] == end[j - p] for j in range(p, span)):
                return p
        return None

    def first(self, tokens: Sequence[int]) -> int | None:
        """The length of the shortest prefix of `tokens` that ends in a repetition, or None:
        where generation checked after every token would have stopped."""
        for n in range(1, len(tokens) + 1):
            if self.tail(tokens[:n]) is not None:
                return n
        return None


class Detector:
    """`Repetition` over C rows, fed the tokens each row generates.

    Per row it keeps the last P tokens and, for every block length p, how many tokens in a
    row have equalled the token p before them: the last `run[p] + p` tokens repeat a p-token
    block, so the rule holds when run[p] >= span(p) - p. Lags are stored in reverse (column
    q is lag P - q), so the tokens a step compares with are one slice of the history.
    """

    def __init__(self, rule: Repetition, rows: int):
        self.rule = rule
        lags = np.arange(rule.max_block, 0, -1)
        self.need_P = np.array([rule.span(b) - b for b in lags], np.int32)
        self.last_CxP = np.full((rows, rule.max_block), -1, np.int32)
        self.run_CxP = np.zeros((rows, rule.max_block), np.int32)

    def reset(self, row: int) -> None:
        """Row `row` starts a new answer."""
        self.last_CxP[row] = -1
        self.run_CxP[row] = 0

    def feed(self, rows: Sequence[int], tokens_RxK: np.ndarray) -> list[int | None]:
        """Appends each row's new tokens (-1: none; a row's tokens come first, and a row with
        fewer than K ends here); returns, per row, how many of its new tokens lead up to and
        include the one that completed a repetition, or None."""
        rows = np.asarray(rows, np.int64)
        new_RxK = np.asarray(tokens_RxK, np.int32).reshape(len(rows), -1)
        p, k = self.last_CxP.shape[1], new_RxK.shape[1]
        seq_RxPK = np.concatenate([self.last_CxP[rows], new_RxK], axis=1)
        run = self.run_CxP[rows]
        first_R = np.full(len(rows), -1)
        for j in range(k):
            token_R = seq_RxPK[:, p + j]
            live_R = token_R >= 0
            if not live_R.any():
                break
            grown = (run + 1) * (seq_RxPK[:, j: p + j] == token_R[:, None])
            run = grown if live_R.all() else np.where(live_R[:, None], grown, run)
            hit_R = (run >= self.need_P).any(axis=1)
            if hit_R.any():
                first_R[hit_R & live_R & (first_R < 0)] = j + 1
        self.last_CxP[rows], self.run_CxP[rows] = seq_RxPK[:, k:], run
        return [int(f) if f > 0 else None for f in first_R]
