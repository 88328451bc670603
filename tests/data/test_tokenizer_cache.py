"""A GGUF file's tokenizer kept on disk between processes (data/tokenizer_cache.py), through
`eagle3kit tokenize --tokenizer SmolLM2.gguf`: a later process loads the kept tokenizer
instead of converting the vocabulary again and writes exactly the same token records
(ids, masks, fingerprint); a damaged entry is built again with one warning line.

Each "process" here is a CLI run in this one after the in-process copy is dropped
(`_gguf_converted`, an lru_cache), so only the disk can serve it.
"""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from eagle3kit.cli.app import app
from eagle3kit.data import tokenizer
from eagle3kit.data.records import ChatRecord, Message, encode
from tests import assets

runner = CliRunner()


@pytest.fixture
def fresh_process(tmp_path, monkeypatch):
    """The cache in `tmp_path/cache`; the in-process copy dropped before and after."""
    monkeypatch.setenv("EAGLE3KIT_TOKENIZER_CACHE", str(tmp_path / "cache"))
    tokenizer._gguf_converted.cache_clear()
    yield tokenizer._gguf_converted.cache_clear
    tokenizer._gguf_converted.cache_clear()


def tokenize(gguf, chats, out):
    return runner.invoke(app, ["tokenize", "--tokenizer", str(gguf), "-i", str(chats), "-o",
                               str(out), "-j", "1"], env={"COLUMNS": "250"})


def test_a_later_process_loads_the_kept_tokenizer_and_a_damaged_entry_is_built_again(
        tmp_path, monkeypatch, smollm2_gguf, fresh_process):
    chats = tmp_path / "chats.jsonl"
    odd = ChatRecord(id="odd", source="test", messages=[  # spaces, scripts, bytes, markup
        Message("user", "  tabs\tand ünïcødé 你好 🤖 <im_start> \u200b\x7f"),
        Message("assistant", "   leading spaces, <think> and\r\nCRLF.")])
    chats.write_bytes(b"".join(encode(c) for c in [*assets.sharegpt_chats(6), odd]))

    r = tokenize(smollm2_gguf, chats, tmp_path / "built.jsonl")
    assert r.exit_code == 0, r.output
    assert "tokenizer cache" not in r.stderr
    built = (tmp_path / "built.jsonl").read_bytes()
    assert built.count(b"\n") == 7, r.stderr
    (entry,) = (tmp_path / "cache").iterdir()
    assert entry.suffix == ".json" and json.loads(entry.read_text())["backend"]

    def no_build(path):
        raise AssertionError("the vocabulary was converted again")

    fresh_process()
    with monkeypatch.context() as m:
        m.setattr(tokenizer, "_gguf_build", no_build)
        r = tokenize(smollm2_gguf, chats, tmp_path / "kept.jsonl")
    assert r.exit_code == 0, r.output
    assert (tmp_path / "kept.jsonl").read_bytes() == built  # ids, masks and fingerprint

    for damage in (entry.read_bytes()[: entry.stat().st_size // 2], b"[]"):
        entry.write_bytes(damage)
        fresh_process()
        r = tokenize(smollm2_gguf, chats, tmp_path / "again.jsonl")
        assert r.exit_code == 0, r.output
        said = [line for line in r.stderr.splitlines() if "tokenizer cache" in line]
        assert len(said) == 1 and said[0].startswith(f"warning: tokenizer cache {entry}: "
                                                     "unreadable ("), r.stderr
        assert said[0].endswith(f"building the tokenizer of {smollm2_gguf.resolve()} again")
        assert (tmp_path / "again.jsonl").read_bytes() == built
        assert json.loads(entry.read_text())["backend"]  # built again, and kept again
