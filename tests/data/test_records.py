"""Chat and token records: round trips, stdin, and errors that name the file and line."""

from __future__ import annotations

import io
import sys

import pytest

from eagle3kit.data.records import (
    ChatRecord,
    Message,
    TokenRecord,
    encode,
    read_chat_records,
    read_token_records,
)
from eagle3kit.errors import InputError


def test_round_trip_and_field_order(tmp_path):
    chat = ChatRecord("c1", "sharegpt", [Message("user", "hi"), Message("assistant", "yo")])
    tok = TokenRecord("c1", [1, 2, 3], [0, 1, 1], "3:0123456789abcdef")
    assert encode(tok) == (b'{"id":"c1","input_ids":[1,2,3],"loss_mask":[0,1,1],'
                           b'"tokenizer":"3:0123456789abcdef"}\n')
    (tmp_path / "c.jsonl").write_bytes(encode(chat) + b"\n" + encode(chat))
    (tmp_path / "t.jsonl").write_bytes(encode(tok))
    assert list(read_chat_records(tmp_path / "c.jsonl")) == [chat, chat]
    assert list(read_token_records(tmp_path / "t.jsonl")) == [tok]


def test_chat_records_without_id_get_file_and_line(tmp_path):
    (tmp_path / "prompts.jsonl").write_text('{"messages": [{"role": "user", "content": "q"}]}\n')
    [record] = read_chat_records(tmp_path / "prompts.jsonl")
    assert record.id == "prompts.jsonl:1" and record.source == ""


def test_reads_stdin(monkeypatch):
    line = encode(TokenRecord("a", [5], [1], "9:0123456789abcdef"))
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(line)))
    assert [r.id for r in read_token_records("-")] == ["a"]


def test_refuses_to_wait_on_a_terminal(monkeypatch):
    class Terminal(io.TextIOWrapper):
        def isatty(self):
            return True

    monkeypatch.setattr(sys, "stdin", Terminal(io.BytesIO(b"")))
    with pytest.raises(InputError, match="<stdin>: no input: stdin is a terminal"):
        list(read_chat_records("-"))


@pytest.mark.parametrize("line,match", [
    (b'{"id": "x", "input_ids": [1, 2], "loss_mask": [1]}', r"t.jsonl:2: not a token record "
     r"\(Object missing required field `tokenizer`\)"),
    (b'{"id": "x", "input_ids": [1], "loss_mask": [2], "tokenizer": "k"}',
     r"t.jsonl:2: .*loss_mask\[0\]"),
    (b'{"id": "x", "input_ids": [1, 2], "loss_mask": [1], "tokenizer": "k"}',
     r"t.jsonl:2: record 'x': 2 input_ids but 1 loss_mask values"),
    (b"{oops", r"t.jsonl:2: not a token record \(JSON is malformed"),
])
def test_bad_token_lines(tmp_path, line, match):
    good = encode(TokenRecord("a", [5], [1], "9:0123456789abcdef"))
    (tmp_path / "t.jsonl").write_bytes(good + line + b"\n")
    with pytest.raises(InputError, match=match):
        list(read_token_records(tmp_path / "t.jsonl"))


def test_bad_chat_lines(tmp_path):
    (tmp_path / "c.jsonl").write_text('{"messages": [{"role": "robot", "content": "x"}]}\n')
    with pytest.raises(InputError, match=r"c.jsonl:1: not a chat record .*messages\[0\].role"):
        list(read_chat_records(tmp_path / "c.jsonl"))
    (tmp_path / "e.jsonl").write_text('{"id": "e", "messages": []}\n')
    with pytest.raises(InputError, match="e.jsonl:1: chat record has no messages"):
        list(read_chat_records(tmp_path / "e.jsonl"))
    with pytest.raises(InputError, match="nope.jsonl: no such file"):
        list(read_chat_records(tmp_path / "nope.jsonl"))


@pytest.mark.parametrize("line,reader,hint", [
    (b'{"id": "c", "messages": [{"role": "user", "content": "hi"}]}', read_token_records,
     "not a token record (Object missing required field `input_ids`); it is a chat record: "
     "run `eagle3kit tokenize` on it first"),
    (b'{"id": "t", "input_ids": [1], "loss_mask": [1], "tokenizer": "k"}', read_chat_records,
     "chat record has no messages; it is a token record, already tokenized"),
    (b'{"conversations": [{"from": "human", "value": "hi"}]}', read_chat_records,
     "chat record has no messages; it is a raw dataset record: normalise it with "
     "`eagle3kit mix` first"),
])
def test_another_steps_artifact_names_the_missing_step(tmp_path, line, reader, hint):
    (tmp_path / "x.jsonl").write_bytes(line + b"\n")
    with pytest.raises(InputError) as e:
        list(reader(tmp_path / "x.jsonl"))
    assert str(e.value).endswith(f"x.jsonl:1: {hint}"), str(e.value)
