"""Rates in progress lines (issue 39, item 10): a big target on a CPU makes less than a token
a second; it shows as such, not as 0 tok/s."""

from __future__ import annotations

from eagle3kit.jobs.progress import per_second


def test_rates_below_one_per_second_keep_their_digits():
    assert [per_second(x) for x in (0.0423, 0.5, 7.25, 42.0, 99.4, 100.2, 12345.6)] == [
        "0.0423", "0.5", "7.25", "42", "99.4", "100", "12,346"]
