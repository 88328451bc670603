"""`regenerate`'s KV cache sized to the work (issue 39, item 6): rows for the conversations,
positions for the longest conversation can reach, each rounded up to a power of two (so that
small runs share their compiled programs; positions at least 256, as eval's caches) and so
less than twice the work's, within --slots and --max-context. A renderer that counts words stands in for a chat template."""

from __future__ import annotations

import collections

from eagle3kit.data.records import ChatRecord, Message
from eagle3kit.jobs.regenerate import Counts, RegenerateConfig, cache_shape, plan_work


class Words:
    """One token per word of every message, two per message for the template around it."""

    def prompt_ids(self, messages) -> list[int]:
        return [0] * sum(2 + len(m.content.split()) for m in messages)


def chat(i: int, *turns: tuple[str, str]) -> ChatRecord:
    return ChatRecord(str(i), "t", [Message(role, text) for q, a in turns
                                    for role, text in (("user", q), ("assistant", a))])


def shape(records, **options):
    cfg = RegenerateConfig(target="t", **options)
    work = plan_work(records, collections.Counter(), cfg.turns == "first", cfg.samples,
                     Counts())
    return cache_shape(cfg, work, Words())


def test_rows_and_positions_follow_the_work():
    short = [chat(i, ("a b c", "old answer")) for i in range(2)]
    # the case: two conversations, first turns, 4 new tokens: not 64 x 4096
    assert shape(short, max_new_tokens=4, max_context=4096, turns="first") == (2, 256)
    assert shape(short, max_new_tokens=4, max_context=200) == (2, 200)
    long_prompt = chat(9, (" ".join(["w"] * 300), "x"))  # 306 positions, 3 conversations
    assert shape([*short, long_prompt], max_new_tokens=4, max_context=4096) == (4, 512)
    # each later turn sees the answers before it: up to --max-new-tokens each
    two_turns = chat(3, ("a", "b"), ("c", "d"))  # last prompt: 3 messages, 6 + 3 tokens
    assert shape([two_turns], max_new_tokens=200, max_context=4096) == (1, 512)  # 9 + 400 + 8
    assert shape([two_turns], max_new_tokens=200, max_context=4096, turns="first") == (1, 256)
    # never above the options: --slots rows, --max-context positions
    assert shape(short * 40, max_new_tokens=4000, max_context=1000, slots=64) == (64, 1000)
    assert shape(short, samples=3, temperature=1.0, max_new_tokens=4,
                 max_context=4096) == (8, 256)  # every sample is a row


def test_the_rounding_stays_below_twice_the_work():
    """Rounded up for fewer shapes, never to the options' size: less than twice the rows and
    positions the work needs (a CPU's host memory holds the cache)."""
    for n in (1, 2, 3, 5, 8, 9, 33, 64, 65):
        rows, _ = shape([chat(i, ("a", "b")) for i in range(n)], max_new_tokens=4,
                        max_context=4096, slots=512)
        assert n <= rows < 2 * n, (n, rows)
    for words in (100, 126, 200, 300, 600, 1100, 2100):
        need = 2 + words + 100  # the prompt (user turn, template) and --max-new-tokens
        _, positions = shape([chat(0, (" ".join(["w"] * words), "x"))], max_new_tokens=100,
                             max_context=8192)
        assert need <= positions < 2 * max(need, 256), (need, positions)
        assert positions & (positions - 1) == 0, positions  # few shapes
