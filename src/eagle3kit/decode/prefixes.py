"""Which tokens each cache row holds, so a request can start from them instead of prefilling
them again (`Request.share`, plain decoding).

A row's keys at slots 0..n-1 are a function of the tokens at those slots alone (causal
attention, RoPE by slot): a row that held the tokens x_0..x_{n-1} serves any prompt that
starts with them. Two uses in `regenerate`:

- a conversation's next turn: its prompt is the last turn's prompt, the generated answer and
  the new user message; the row that answered keeps its keys when it finishes, and the next
  turn takes that row and prefills only what follows the common prefix;
- `--samples`: the samples of one conversation ask the same first prompt; one prefills it,
  the others copy its row and prefill the prompt's last token alone (its logits are what
  each sample's first token is drawn from).

Only requests with the same `share` key look at each other's rows (a key per input
conversation: other conversations' rows are never searched). A row's held tokens are its
prompt and its answer but the newest token (whose keys the next step writes); what the
device wrote past them (padding of a prefill piece, idle steps of a finished row) lies
beyond and is overwritten before any query reads it.

At least the prompt's last token is always prefilled: its logits give the first token.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens a and b share."""
    n = min(len(a), len(b))
    if n == 0:
        return 0
    differ = np.asarray(a[:n]) != np.asarray(b[:n])
    return int(differ.argmax()) if differ.any() else n


class Prefixes:
    """Per cache row: the share key and tokens of the request it holds (live or finished),
    and when it was freed (a row no request shares is taken first, then the one freed
    longest ago)."""

    def __init__(self, rows: int):
        self.owner: list[tuple[Any, Sequence[int], list[int]] | None] = [None] * rows
        self.by_key: dict[Any, set[int]] = {}
        self.freed_at = [0] * rows
        self.clock = 0

    def held(self, i: int) -> list[int]:
        """The tokens row i holds keys for (its prompt once this step's prefill ran)."""
        _, prompt, answer = self.owner[i]
        return list(prompt) + answer[:-1]

    def place(self, share: Any, prompt: Sequence[int], free: Sequence[int],
              skip: set[int]) -> tuple[int, int | None, int]:
        """(row for a request, row to copy keys from or None, prompt tokens already held):
        the row of its key holding the longest prefix of `prompt` (`skip`: rows that are
        not to be read from), kept when it is free, else copied into a free row."""
        best, length = None, 0
        for j in sorted(self.by_key.get(share, ()) if share is not None else ()):
            if j in skip:
                continue
            n = min(common_prefix(self.held(j), prompt), len(prompt) - 1)
            if n > length or (n == length and n and j in free and best not in free):
                best, length = j, n
        if best is not None and best in free:
            return best, None, length
        idle = [i for i in free if self.owner[i] is None]
        row = idle[0] if idle else min(free, key=lambda i: (self.freed_at[i], i))
        return row, best, length

    def own(self, i: int, share: Any, prompt: Sequence[int], answer: list[int]) -> None:
        """Row i now holds this request (`answer`: the list its tokens are appended to)."""
        old = self.owner[i]
        if old is not None:
            self.by_key[old[0]].discard(i)
            if not self.by_key[old[0]]:
                del self.by_key[old[0]]
        self.owner[i] = None
        if share is not None:
            self.owner[i] = (share, prompt, answer)
            self.by_key.setdefault(share, set()).add(i)

    def freed(self, i: int) -> None:
        """Row i's request finished: its keys stay until another request takes the row."""
        self.clock += 1
        self.freed_at[i] = self.clock
        if self.owner[i] is not None:
            share, prompt, answer = self.owner[i]
            self.owner[i] = (share, prompt, list(answer))  # the caller's list may change
