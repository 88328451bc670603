"""Rows that keep their keys (Request.share, decode/prefixes.py): a conversation's next turn
extends the row that answered the last one, and samples of one prompt copy the row that
prefilled it. The answers must be those of prefilling every prompt from scratch, token for
token (fp32), on a target whose answers depend on every key (`chaotic`): a key copied from
the wrong row or slot, or a prefix one token too long, changes them.
"""

from __future__ import annotations

import numpy as np
import pytest

from eagle3kit.decode.conversations import drive
from eagle3kit.decode.engine import Engine, EngineConfig, Request, Sampling
from eagle3kit.decode.prefixes import Prefixes, common_prefix

TURNS, NEW = 3, 10


def conversations(n: int) -> list[list[list[int]]]:
    """n conversations of TURNS user messages (token ids), of different lengths."""
    rng = np.random.default_rng(3)
    return [[[int(x) for x in rng.integers(0, 96, 6 + (7 * c + 5 * t) % 23)]
             for t in range(TURNS)] for c in range(n)]


class Chat:
    """One conversation (sample `sample` of conversation `index`) answered turn by turn. The
    next prompt is the last one, the answer and the next user message: as a chat template
    renders it, where an odd conversation's template rewrites the answer's second token (a
    re-tokenized answer), so its rows hold a shorter prefix than the whole last turn."""

    def __init__(self, index: int, sample: int, users: list[list[int]]):
        self.index, self.sample, self.users = index, sample, users
        self.prompts: list[list[int]] = []
        self.answers: list[list[int]] = []

    def prompt(self) -> list[int] | None:
        t = len(self.answers)
        if t == len(self.users):
            return None
        if t == 0:
            return list(self.users[0])
        answer = list(self.answers[-1])
        if self.index % 2 and len(answer) > 1:
            answer[1] = (answer[1] + 1) % 96
        return self.prompts[-1] + answer + [95] + self.users[t]


def regenerate(tcfg, w, mesh, chats: list[Chat], share: bool, sampling: Sampling,
               rows: int = 4, stagger: bool = False, **extra) -> Engine:
    """`stagger`: answers of different lengths (rows finish apart); `extra`: more
    EngineConfig (test_mixed: prompts riding in decode steps)."""
    engine = Engine(tcfg, w, mesh, [], EngineConfig(rows=rows, max_context=256, sync_every=4,
                                                    prefill_chunk=32, sampling=sampling,
                                                    **extra))

    def request(chat: Chat, ids: list[int]) -> Request:
        chat.prompts.append(ids)
        seed = 1000 * chat.index + 10 * chat.sample + len(chat.answers)
        new = NEW - len(chat.answers) - (3 * chat.index + chat.sample) % 5 * stagger
        return Request((chat, ids), ids, new, seed,
                       share=chat.index if share else None)

    def answered(chat: Chat, ids: list[int], c) -> None:
        assert c.prompt_len == len(ids)
        chat.answers.append(c.tokens)

    drive(engine, chats, Chat.prompt, request, answered, lambda chat: None)
    return engine


@pytest.mark.parametrize("samples, sampling", [(1, Sampling()),
                                                (2, Sampling(temperature=0.9, top_p=0.95))])
def test_turns_and_samples_that_reuse_rows_answer_as_from_scratch(tiny, chaotic, samples,
                                                                  sampling):
    """5 conversations of 3 turns (x2 samples, sampled) on 4 rows: later turns extend the
    row that answered (or a sibling's), samples copy the row that prefilled their prompt;
    every answer equals the one of prefilling every prompt whole."""
    tcfg, *_, mesh = tiny
    _, w = chaotic
    users = conversations(5)

    def chats():
        return [Chat(c, k, u) for c, u in enumerate(users) for k in range(samples)]

    scratch, shared = chats(), chats()
    base = regenerate(tcfg, w, mesh, scratch, False, sampling)
    engine = regenerate(tcfg, w, mesh, shared, True, sampling)
    assert [c.answers for c in shared] == [c.answers for c in scratch]
    assert [c.prompts for c in shared] == [c.prompts for c in scratch]
    assert base.reused_tokens == 0
    # the work saved is the prompt tokens held: every later turn's, and a sample's first
    assert engine.reused_tokens > 0
    assert engine.prefilled_tokens + engine.reused_tokens == base.prefilled_tokens
    if samples > 1:
        assert ("copy", engine.prefill_batch) in engine.programs
        # a conversation's samples answer differently: their streams are their own
        assert all(a.answers != b.answers for a, b in zip(shared[::2], shared[1::2],
                                                          strict=True))


def test_a_later_turn_prefills_only_what_its_row_does_not_hold(tiny, chaotic):
    """One conversation on one row: turn 2's prompt holds turn 1's prompt and answer; the
    row holds all of it but the answer's newest token (never fed), so exactly the rest is
    prefilled; the odd conversation's rewritten answer token cuts the held prefix there."""
    tcfg, *_, mesh = tiny
    _, w = chaotic
    users = conversations(2)
    for index in (0, 1):
        chat = Chat(index, 0, users[index])
        chat.users = chat.users[:2]
        engine = regenerate(tcfg, w, mesh, [chat], True, Sampling(), rows=1)
        first, second = chat.prompts
        held = len(first) + (len(chat.answers[0]) - 1 if index == 0 else 1)
        assert engine.reused_tokens == held
        assert engine.prefilled_tokens == len(first) + len(second) - held


def test_placement_keeps_a_free_row_copies_a_live_one_and_never_reads_other_keys():
    p = Prefixes(4)
    assert common_prefix([1, 2, 3], [1, 2, 4, 5]) == 2 and common_prefix([], [1]) == 0
    answer = [7, 8, 9]
    p.own(2, "a", [1, 2, 3], answer)  # live: holds the prompt and the answer but its newest
    assert p.held(2) == [1, 2, 3, 7, 8]
    assert p.place("a", [1, 2, 3, 7, 8, 0], [0, 1, 3], set()) == (0, 2, 5)  # copied
    assert p.place("a", [1, 2, 3], [0, 1, 3], set()) == (0, 2, 2)  # last token prefilled
    assert p.place("b", [1, 2, 3, 7], [0, 1, 3], set()) == (0, None, 0)  # another key
    assert p.place("a", [1, 2, 3, 7], [0, 1, 3], {2}) == (0, None, 0)  # not to be read
    p.freed(2)
    answer.append(10)  # the caller's list: what the row holds was fixed when it finished
    assert p.held(2) == [1, 2, 3, 7, 8]
    assert p.place("a", [1, 2, 3, 7, 8, 0], [0, 2, 3], set()) == (2, None, 5)  # kept
    # no row shared by nobody is left: the one freed longest ago is taken
    p.own(0, "c", [5], [])
    p.freed(0)
    p.own(1, "d", [6], [])
    p.freed(1)
    assert p.place("e", [4], [0, 1], set()) == (0, None, 0)
    p.own(0, "e", [4], [])
    assert "c" not in p.by_key and p.by_key["e"] == {0}
