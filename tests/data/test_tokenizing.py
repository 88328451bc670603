"""The tokenize driver: order and bytes independent of the number of jobs, truncation,
counted drops, and malformed lines (an error naming the line, or counted skips)."""

from __future__ import annotations

import msgspec
import pytest

from eagle3kit.data.chat import render
from eagle3kit.data.fingerprint import tokenizer_fingerprint
from eagle3kit.data.records import ChatRecord, Message, TokenRecord, encode
from eagle3kit.data.tokenizing import Job, TokenizeReport, tokenize_lines
from eagle3kit.errors import InputError
from tests import assets

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def tok():
    return assets.smollm2_tokenizer()


@pytest.fixture(scope="module")
def lines():
    return [(i + 1, encode(c)) for i, c in enumerate(assets.sharegpt_chats(70))]


def _job(tok, max_length=None):
    return Job(tok, tokenizer_fingerprint(tok, "smollm2").key, "in.jsonl", max_length)


def test_output_is_identical_for_any_number_of_jobs(tok, lines):
    report = TokenizeReport()
    one = b"".join(tokenize_lines(lines, _job(tok, 1024), jobs=1, report=report))
    two = b"".join(tokenize_lines(lines, _job(tok, 1024), jobs=2))
    assert one == two and one.count(b"\n") == report.written > 50


def test_records_are_the_rendered_conversations(tok, lines):
    out = list(tokenize_lines(lines[:5], _job(tok)))
    for (_, line), data in zip(lines[:5], out, strict=True):
        chat = msgspec.json.decode(line, type=ChatRecord)
        rec = msgspec.json.decode(data, type=TokenRecord)
        assert (rec.input_ids, rec.loss_mask) == tuple(map(list, render(tok, chat.messages)))
        assert rec.id == chat.id and rec.tokenizer == tokenizer_fingerprint(tok, "x").key


def test_truncation_and_drops_are_counted(tok, lines):
    report = TokenizeReport()
    special = ChatRecord("sp", "t", [Message("user", "say <|endoftext|>"),
                                     Message("assistant", "ok")])
    no_answer = ChatRecord("na", "t", [Message("user", "hello?")])
    extra = [(71, encode(special)), (72, encode(no_answer))]
    out = list(tokenize_lines(lines + extra, _job(tok, 256), report=report))
    lengths = [len(msgspec.json.decode(d, type=TokenRecord).input_ids) for d in out]
    assert max(lengths) == 256 and report.truncated == lengths.count(256) > 0
    assert report.records == 72 and report.written == len(out)
    assert report.dropped["special-token text in content"] == 1
    assert report.dropped["no assistant turn"] == 1
    # long first user turns leave nothing to learn within 256 tokens
    assert report.written + sum(report.dropped.values()) == 72


def test_malformed_line_is_an_error_or_a_counted_skip(tok, lines):
    bad = lines[:3] + [(4, b'{"id": "x", "messages": [{"role": "robot", "content": "hi"}]}\n')]
    with pytest.raises(InputError, match=r"in.jsonl:4: not a chat record .*--skip-invalid"):
        list(tokenize_lines(bad, _job(tok), jobs=2))
    report = TokenizeReport()
    assert len(list(tokenize_lines(bad, _job(tok), skip_invalid=True, report=report))) == 3
    assert report.invalid == {"not a chat record": 1}
