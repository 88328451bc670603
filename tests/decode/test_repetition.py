"""Degenerate repetition: the rule on token lists, and the batched detector the engine feeds at
its sync points against the rule applied after every token."""

from __future__ import annotations

import numpy as np
import pytest

from eagle3kit.decode.repetition import Detector, Repetition


def test_the_rule_on_token_lists():
    rule = Repetition(copies=3, min_tokens=8, max_block=4)
    assert rule.tail([5, 1, 2, 1, 2, 1, 2, 1, 2]) == 2  # 4 copies of [1, 2]: 8 tokens
    assert rule.tail([1, 2, 1, 2, 1, 2, 1]) is None  # 7 tokens < min_tokens
    assert rule.tail([7] * 8) == 1 and rule.tail([7] * 7) is None
    assert rule.tail([1, 2, 3] * 3) == 3  # three copies of 3 tokens: 9 >= 8
    assert rule.tail([1, 2, 3] * 2 + [1, 2]) is None
    assert rule.tail([1, 2, 3, 4, 5] * 5) is None  # a block longer than max_block
    # the loop is caught at the token that completes it, wherever it starts
    assert rule.first([9, 8] + [1, 2, 3] * 5) == 2 + 9
    assert rule.first(list(range(30))) is None
    with pytest.raises(ValueError):
        Repetition(copies=1)


def _random_rows(rng, n):
    """Token lists that often end in loops of several block lengths, after a random start."""
    rows = []
    for _ in range(n):
        block = list(rng.integers(0, 4, rng.integers(1, 9)))
        rows.append(list(rng.integers(0, 5, rng.integers(0, 25)))
                    + block * int(rng.integers(1, 7)) + list(rng.integers(0, 4, 12)))
    return rows


@pytest.mark.parametrize("k", [1, 3, 8])
def test_the_detector_stops_where_the_rule_does_after_every_token(k):
    """Many rows fed together in chunks of k tokens (a row's last chunk short, as when it
    ends): each row's hit is where `Repetition.first` says, whatever k, and rows do not
    disturb each other."""
    rng = np.random.default_rng(k)
    rule = Repetition(copies=3, min_tokens=9, max_block=7)
    rows = _random_rows(rng, 60)
    want = [rule.first(r) for r in rows]
    assert sum(w is not None for w in want) >= 20 and want.count(None) >= 5
    detector = Detector(rule, len(rows) + 2)
    got: list[int | None] = [None] * len(rows)
    open_rows = list(range(len(rows)))
    fed = 0
    while open_rows:
        chunk = [rows[r][fed: fed + k] for r in open_rows]
        hits = detector.feed([r + 2 for r in open_rows],  # rows of the detector != list index
                             [c + [-1] * (k - len(c)) for c in chunk])
        for r, c, hit in zip(open_rows, chunk, hits, strict=True):
            if hit is not None:
                assert hit <= len(c)
                got[r] = fed + hit
        open_rows = [r for r, c, hit in zip(open_rows, chunk, hits, strict=True)
                     if hit is None and len(c) == k and fed + k < len(rows[r])]
        fed += k
    assert got == want
    # a reset row starts over: its old tokens do not count
    detector.reset(2)
    assert detector.feed([2], [[3, 3]]) == [None]
