"""Source specs, the readers (JSONL, JSON arrays incl. the real cut-off ShareGPT file,
parquet, hf:) and the normalisation of ShareGPT, OpenAI/UltraChat and PerfectBlend records."""

from __future__ import annotations

import json

import pytest

from eagle3kit.data import sources
from eagle3kit.data.records import Message
from eagle3kit.data.sources import (
    Raw,
    Reader,
    RecordError,
    drop_reason,
    normalise,
    parse_hub,
    parse_source,
)
from eagle3kit.errors import InputError

ULTRACHAT = {"prompt": "Hi", "prompt_id": "u-1", "messages": [
    {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]}
PERFECTBLEND = {"conversations": [{"from": "system", "value": "Be brief."},
                                  {"from": "human", "value": "2+2?"},
                                  {"from": "gpt", "value": "4"}], "source": "metamath"}


def _write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_parse_source_weights_and_hub(tmp_path):
    f = _write_jsonl(tmp_path / "a.jsonl", [ULTRACHAT])
    assert parse_source(f"{f}:0.35").weight == 0.35
    assert parse_source(str(f)).weight == 1.0
    s = parse_source("hf:HuggingFaceH4/ultrachat_200k@train_sft:0.35")
    assert (s.location, s.weight) == ("hf:HuggingFaceH4/ultrachat_200k@train_sft", 0.35)
    assert parse_hub(s.location) == ("HuggingFaceH4/ultrachat_200k", None, "train_sft")
    assert parse_hub(parse_source("hf:org/set:cfg").location) == ("org/set", "cfg", "train")


@pytest.mark.parametrize("weight", ["0", "-1", "nan", "inf", "abc", "0,4"])
def test_parse_source_rejects_bad_weights(tmp_path, weight):
    f = _write_jsonl(tmp_path / "a.jsonl", [ULTRACHAT])
    with pytest.raises(InputError, match=f"a.jsonl:{weight}: weight must be a positive"):
        parse_source(f"{f}:{weight}")


def test_parse_source_rejects_missing_and_unknown(tmp_path):
    with pytest.raises(InputError, match="missing.jsonl: no such file"):
        parse_source(str(tmp_path / "missing.jsonl"))
    (tmp_path / "data.csv").write_text("a,b\n")
    with pytest.raises(InputError, match="unknown source type"):
        parse_source(str(tmp_path / "data.csv"))


def test_jsonl_reader_names_the_bad_line(tmp_path):
    f = tmp_path / "d.jsonl"
    f.write_text(json.dumps(ULTRACHAT) + "\n\n{broken\n")
    raws = list(Reader(parse_source(str(f))))
    assert [r.error is None for r in raws] == [True, False]
    with pytest.raises(RecordError, match=r"d.jsonl:3: malformed JSON"):
        normalise(raws[1], "auto", "d.jsonl")


@pytest.mark.parametrize("chunk", [7, 64, 8 << 20])
def test_json_array_streams_across_chunks(tmp_path, monkeypatch, chunk):
    monkeypatch.setattr(sources, "_CHUNK", chunk)
    rows = [PERFECTBLEND, {**ULTRACHAT, "prompt_id": "ü-ß-€-😀"}] * 3
    f = tmp_path / "a.json"
    f.write_text(json.dumps(rows, indent=2, ensure_ascii=False))
    reader = Reader(parse_source(str(f)))
    assert [r.value for r in reader] == rows
    assert reader.notes == []


@pytest.mark.parametrize("chunk", [5, 8 << 20])
def test_json_array_cut_off_recovers_complete_records(tmp_path, monkeypatch, chunk):
    monkeypatch.setattr(sources, "_CHUNK", chunk)
    full = json.dumps([PERFECTBLEND, ULTRACHAT, {**ULTRACHAT, "prompt": "ü€😀"}],
                      ensure_ascii=False).encode()
    cut = full[: full.rindex("😀".encode()) + 2]  # inside the last record, mid-character
    f = tmp_path / "cut.json"
    f.write_bytes(cut)
    reader = Reader(parse_source(str(f)))
    assert [r.value for r in reader] == [PERFECTBLEND, ULTRACHAT]
    complete = json.dumps([PERFECTBLEND, ULTRACHAT]).encode().rstrip(b"]") + b", "
    tail = len(cut) - len(complete)  # the incomplete record, from its "{"
    assert len(reader.notes) == 1 and f"last {tail:,} bytes" in reader.notes[0]


@pytest.mark.parametrize("text,match", [
    ("", "empty file"), ('{"a": 1}', "not a JSON array"),
    ('[{"a": 1},\n {"a": oops}]', r"bad.json:2: record 2: malformed JSON"),
    ('[{"a": 1} {"a": 2}]', "expected ',' or ']' after record 1"),
    ('[{"a": 1}] [', "unexpected data after the closing"),
])
def test_json_array_errors_name_file_and_line(tmp_path, text, match):
    f = tmp_path / "bad.json"
    f.write_text(text)
    with pytest.raises(InputError, match=match):
        list(Reader(parse_source(str(f))))


@pytest.mark.slow
def test_real_cut_off_sharegpt_file(sharegpt_path):
    """The packaged ShareGPT file stops mid-record: every complete record is recovered."""
    reader = Reader(parse_source(str(sharegpt_path)))
    n = 0
    for raw in reader:
        n += 1
        assert raw.value["id"] and "conversations" in raw.value
    assert n == 17_671
    assert len(reader.notes) == 1 and "the last 2,987 bytes" in reader.notes[0]


def test_parquet_reader_and_unreadable_parquet(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    f = tmp_path / "blend.parquet"
    pq.write_table(pa.Table.from_pylist([PERFECTBLEND] * 3), f)
    raws = list(Reader(parse_source(str(f))))
    assert [r.value for r in raws] == [PERFECTBLEND] * 3 and raws[2].where.endswith("row 3")
    bad = tmp_path / "bad.parquet"
    bad.write_bytes(b"PAR1 not really")
    with pytest.raises(InputError, match="bad.parquet: not a readable parquet file"):
        list(Reader(parse_source(str(bad))))


@pytest.mark.slow
def test_hub_source_through_datasets(tmp_path):
    """hf: goes through datasets.load_dataset (streaming); a local data set directory
    exercises the same code as a Hub id, offline."""
    d = tmp_path / "ultrachat"
    d.mkdir()
    _write_jsonl(d / "train.jsonl", [ULTRACHAT] * 2)
    raws = list(Reader(parse_source(f"hf:{d}@train")))
    assert [normalise(r, "auto", "u").id for r in raws] == ["u-1", "u-1"]
    with pytest.raises(InputError, match="cannot load the data set"):
        list(Reader(parse_source(f"hf:{tmp_path / 'missing'}")))


def test_normalise_sharegpt_roles():
    roles = ["system", "human", "gpt", "user", "chatgpt", "bing", "bard"]
    raw = Raw("x:1", 1, {"id": "s1", "conversations": [{"from": r, "value": r} for r in roles]})
    rec = normalise(raw, "auto", "sharegpt.json")
    assert (rec.id, rec.source) == ("s1", "sharegpt.json")
    assert [m.role for m in rec.messages] == ["system", "user", "assistant", "user",
                                              "assistant", "assistant", "assistant"]


def test_normalise_openai_ultrachat_and_perfectblend():
    rec = normalise(Raw("u:1", 1, ULTRACHAT), "auto", "u")
    assert rec.id == "u-1" and rec.messages[1] == Message("assistant", "Hello!")
    parts = {"messages": [{"role": "user", "content": [{"type": "text", "text": "a"},
                                                       {"type": "text", "text": "b"}]}]}
    assert normalise(Raw("p:1", 7, parts), "openai", "p").messages[0].content == "ab"
    assert normalise(Raw("p:1", 7, parts), "openai", "p").id == "p:7"
    blend = normalise(Raw("b:1", 1, PERFECTBLEND), "perfectblend", "blend.parquet")
    assert [m.role for m in blend.messages] == ["system", "user", "assistant"]


@pytest.mark.parametrize("value,fmt,reason", [
    ({"text": "hi"}, "auto", "unknown record shape"),
    ([1, 2], "auto", "unknown record shape"),
    ({"conversations": [{"from": "tool", "value": "x"}]}, "auto", "unknown role"),
    (PERFECTBLEND, "openai", "unknown record shape"),  # --format overrides detection
    ({"messages": [{"role": "user", "content": [{"type": "image"}]}]}, "auto",
     "non-text content"),
])
def test_normalise_refuses_unknown_shapes(value, fmt, reason):
    with pytest.raises(RecordError, match="x.jsonl:4: " + reason) as e:
        normalise(Raw("x.jsonl:4", 4, value), fmt, "x")
    assert e.value.reason == reason


@pytest.mark.parametrize("messages,reason", [
    ([], "empty conversation"),
    ([("user", "hi"), ("assistant", "  ")], "empty content"),
    ([("system", "s"), ("user", "hi")], "no assistant turn"),
    ([("assistant", "I start"), ("user", "ok")], None),
])
def test_drop_reasons(messages, reason):
    rec = normalise(Raw("x", 1, {"messages": [{"role": r, "content": c} for r, c in messages]}),
                    "auto", "x")
    assert drop_reason(rec) == reason
