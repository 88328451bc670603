"""Masked-token counting and the d2t / t2d choice of vocab-select."""

from __future__ import annotations

import numpy as np
import pytest

from eagle3kit.data.counting import count_masked, select
from eagle3kit.data.fingerprint import Fingerprint, parse_key
from eagle3kit.data.records import TokenRecord, encode
from eagle3kit.errors import InputError, MismatchError

KEY = "12:0123456789abcdef"


def _records(path, rows, key=KEY):
    path.write_bytes(b"".join(encode(TokenRecord(f"r{i}", ids, mask, key))
                              for i, (ids, mask) in enumerate(rows)))
    return path


def _check_invariants(vocab, size, v):
    d2t, t2d = vocab.d2t, vocab.t2d
    assert d2t.dtype == np.int64 and d2t.shape == (size,)
    assert t2d.dtype == np.bool_ and t2d.shape == (v,)
    used = np.arange(size) + d2t
    assert np.all(np.diff(used) > 0)
    assert np.array_equal(used, np.flatnonzero(t2d))


def test_counts_only_masked_tokens(tmp_path):
    f = _records(tmp_path / "t.jsonl", [([1, 5, 5, 7], [0, 1, 1, 0]), ([5, 9, 1], [1, 1, 1])])
    c = count_masked(f)
    assert c.key == KEY and c.records == 2 and c.masked == 5
    assert np.flatnonzero(c.counts).tolist() == [1, 5, 9] and c.counts[5] == 3


def test_top_n_ties_by_id_and_invariants(tmp_path):
    # counts: 3 -> 4, 8 -> 2, 2 -> 2, 10 -> 2, 6 -> 1
    rows = [([3, 3, 3, 3, 8, 8, 2, 2, 10, 10, 6], [1] * 11)]
    chosen = select(count_masked(_records(tmp_path / "t.jsonl", rows)), 3)
    assert chosen.vocab.used_ids.tolist() == [2, 3, 8]  # 3, then the tie 2/8/10 by id
    assert chosen.filled == 0 and chosen.coverage == pytest.approx(8 / 11)
    _check_invariants(chosen.vocab, 3, 12)


def test_fills_with_lowest_unused_ids_when_too_few_occur(tmp_path):
    chosen = select(count_masked(_records(tmp_path / "t.jsonl", [([4, 9, 9], [1, 1, 1])])), 5)
    assert chosen.filled == 3 and chosen.vocab.used_ids.tolist() == [0, 1, 2, 4, 9]
    assert chosen.coverage == 1.0
    _check_invariants(chosen.vocab, 5, 12)
    meta = chosen.metadata(Fingerprint("tok", 12, "0123456789abcdef"))
    assert meta["filled"] == "3" and meta["draft_vocab_size"] == "5"
    assert meta["target_vocab_size"] == "12" and meta["masked_tokens"] == "3"
    assert Fingerprint.from_json(meta["tokenizer"]).key == KEY


def test_size_larger_than_the_vocab_is_an_error(tmp_path):
    counts = count_masked(_records(tmp_path / "t.jsonl", [([1], [1])]))
    with pytest.raises(InputError, match="--size 13 exceeds the target vocab of 12"):
        select(counts, 13)


def test_other_tokenizer_in_the_data_is_refused(tmp_path):
    f = _records(tmp_path / "t.jsonl", [([1], [1])])
    with open(f, "ab") as out:
        out.write(encode(TokenRecord("other", [1], [1], "12:fedcba9876543210")))
    with pytest.raises(MismatchError, match=r"t.jsonl: line 2 \(record 'other'\) was made "
                                            r"with tokenizer 12:fedcba9876543210"):
        count_masked(f)
    with pytest.raises(MismatchError, match="the --tokenizer given is 12:aaaaaaaaaaaaaaaa"):
        count_masked(_records(tmp_path / "u.jsonl", [([1], [1])]), "12:aaaaaaaaaaaaaaaa")


@pytest.mark.parametrize("rows,key,match", [
    ([([12], [1])], KEY, r"t.jsonl:1: record 'r0' has token id 12, outside"),
    ([([1], [1])], "twelve", r"malformed tokenizer fingerprint 'twelve'"),
    ([], KEY, "no token records"),
])
def test_bad_token_data(tmp_path, rows, key, match):
    with pytest.raises(InputError, match=match):
        count_masked(_records(tmp_path / "t.jsonl", rows, key))


def test_no_masked_tokens_is_an_error(tmp_path):
    with pytest.raises(InputError, match="no loss-masked tokens"):
        select(count_masked(_records(tmp_path / "t.jsonl", [([1, 2], [0, 0])])), 2)


def test_parse_key():
    assert parse_key(KEY) == (12, "0123456789abcdef")
