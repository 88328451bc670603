"""`eagle3kit vocab-select` through the CLI on real tokenized ShareGPT conversations."""

from __future__ import annotations

import numpy as np
import pytest
from typer.testing import CliRunner

from eagle3kit.cli.app import app
from eagle3kit.data.fingerprint import Fingerprint, tokenizer_fingerprint
from eagle3kit.data.records import TokenRecord, encode, read_token_records
from eagle3kit.io.draft_io import read_vocab
from tests import assets
from tests.data import chat_tokenizers

pytestmark = pytest.mark.slow
runner = CliRunner()
V = 49152


def vocab_select(*args, input=None):
    return runner.invoke(app, ["vocab-select", *map(str, args)], input=input,
                         env={"COLUMNS": "250"})


@pytest.fixture(scope="module")
def records(tmp_path_factory):
    """Real ShareGPT conversations rendered with SmolLM2's template (as tokenize does)."""
    path = tmp_path_factory.mktemp("tok") / "train.jsonl"
    assets.write_token_records(path, assets.sharegpt_chats(40), chat_tokenizers.smollm2(),
                               max_length=1024)
    return path


def _masked_counts(path):
    counts = np.zeros(V, np.int64)
    for r in read_token_records(path):
        np.add.at(counts, np.asarray(r.input_ids)[np.asarray(r.loss_mask, bool)], 1)
    return counts


def test_top_masked_tokens_from_file_and_stdin(records, tmp_path):
    out = tmp_path / "vocab.safetensors"
    r = vocab_select("--size", 2000, "-i", records, "-o", out)
    assert r.exit_code == 0, r.output
    vocab, meta = read_vocab(out)
    used = np.arange(2000) + vocab.d2t
    assert vocab.d2t.dtype == np.int64 and vocab.t2d.dtype == np.bool_
    assert vocab.t2d.shape == (V,) and np.all(np.diff(used) > 0)
    assert np.array_equal(used, np.flatnonzero(vocab.t2d))
    counts = _masked_counts(records)
    expected = np.lexsort((np.arange(V), -counts))[:2000]  # by -count, then id
    assert np.array_equal(used, np.sort(expected))
    assert meta["coverage"] == f"{counts[used].sum() / counts.sum():.6f}"
    assert meta["masked_tokens"] == str(counts.sum()) and meta["filled"] == "0"
    assert Fingerprint.from_json(meta["tokenizer"]).key == tokenizer_fingerprint(
        chat_tokenizers.smollm2(), "x").key
    assert f"coverage {float(meta['coverage']):.2%}" in r.stderr
    piped = tmp_path / "piped.safetensors"
    assert vocab_select("--size", 2000, "-o", piped, input=records.read_text()).exit_code == 0
    assert piped.read_bytes() == out.read_bytes()  # deterministic, whatever the input route


def test_dash_streams_to_stdout(records, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert vocab_select("--size", 100, "-i", records, "-o", "v.safetensors").exit_code == 0
    r = vocab_select("--size", 100, "-i", records, "-o", "-")
    assert r.exit_code == 0, r.output
    assert r.stdout_bytes == (tmp_path / "v.safetensors").read_bytes()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["v.safetensors"]  # no file named -


def test_fills_and_says_so(records, tmp_path):
    distinct = int((_masked_counts(records) > 0).sum())
    r = vocab_select("--size", distinct + 10, "-i", records, "-o", tmp_path / "v.safetensors")
    assert r.exit_code == 0, r.output
    assert "filled 10 draft ids with the lowest unused token ids" in r.stderr
    assert read_vocab(tmp_path / "v.safetensors")[1]["filled"] == "10"


def test_tokenizer_check_records_the_name_and_refuses_another(records, tmp_path):
    r = vocab_select("--size", 100, "-i", records, "-o", tmp_path / "v.safetensors",
                     "--tokenizer", chat_tokenizers.saved("smollm2"))
    assert r.exit_code == 0, r.output
    assert Fingerprint.from_json(read_vocab(tmp_path / "v.safetensors")[1]["tokenizer"]).name
    other = vocab_select("--size", 100, "-i", records, "-o", tmp_path / "w.safetensors",
                         "--tokenizer", chat_tokenizers.saved("llama3"))
    assert other.exit_code == 3 and "the --tokenizer given is" in other.stderr
    assert not (tmp_path / "w.safetensors").exists()


def test_tokenizer_with_one_token_renamed_is_refused(records, tmp_path):
    twin = assets.with_renamed_token(chat_tokenizers.saved("smollm2"), tmp_path / "twin")
    r = vocab_select("--size", 100, "-i", records, "-o", tmp_path / "v.safetensors",
                     "--tokenizer", twin)
    assert r.exit_code == 3 and "the --tokenizer given is" in r.stderr, r.output
    assert not (tmp_path / "v.safetensors").exists()


def test_data_from_two_tokenizers_is_refused(records, tmp_path):
    mixed = tmp_path / "mixed.jsonl"
    mixed.write_bytes(records.read_bytes() + encode(TokenRecord("x", [1], [1],
                                                                "49152:0000000000000000")))
    n = len(records.read_text().split("\n")) - 1
    r = vocab_select("-i", mixed, "-o", tmp_path / "v.safetensors")
    assert r.exit_code == 3 and f"line {n + 1} (record 'x') was made with tokenizer" in r.stderr
    assert not (tmp_path / "v.safetensors").exists()


@pytest.mark.parametrize("case", ["size", "empty", "malformed", "missing"])
def test_bad_input_one_error_line_no_output(records, tmp_path, case):
    bad = tmp_path / "bad.jsonl"
    first = records.read_text().split("\n")[0]
    text, args, message = {
        "size": (first + "\n", ["--size", V + 1], "--size 49,153 exceeds the target vocab"),
        "empty": ("", [], "no token records (empty input)"),
        "malformed": (first + "\n{nope\n", [], f"{bad}:2: not a token record"),
        "missing": (None, [], "nope.jsonl: no such file"),
    }[case]
    if text is not None:
        bad.write_text(text)
    out = tmp_path / "out" / "vocab.safetensors"
    r = vocab_select("-i", bad if text is not None else tmp_path / "nope.jsonl", "-o", out,
                     *args)
    assert r.exit_code == 2 and message in r.stderr, r.output
    assert r.stderr.count("error:") == 1 and not out.parent.exists()


def test_output_is_required_and_help_has_an_example():
    assert vocab_select("--size", 10).exit_code == 2
    r = runner.invoke(app, ["vocab-select", "--help"])
    assert r.exit_code == 0 and "Example:" in r.stdout and "vocab-select --size" in r.stdout
