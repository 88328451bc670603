"""Weighted sampling without replacement, its determinism, and the interleaving of sources."""

from __future__ import annotations

import collections
import json
import random

import pytest

from eagle3kit.data.mixing import interleave, mix, quotas, sample
from eagle3kit.data.records import ChatRecord, Message
from eagle3kit.data.sources import parse_source
from eagle3kit.errors import InputError


def _source(path, n, prefix, bad_lines=()):
    lines = []
    for i in range(n):
        lines.append(json.dumps({"id": f"{prefix}{i}", "messages": [
            {"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"a{i}"}]}))
    for at in bad_lines:
        lines.insert(at, "{not json")
    path.write_text("\n".join(lines) + "\n")
    return path


def _ids(stream):
    return [r.id for r in stream]


def test_quotas_add_up_exactly():
    assert quotas([0.45, 0.35, 0.2], 54000) == [24300, 18900, 10800]
    assert quotas([1, 1, 1], 10) == [4, 3, 3]
    assert quotas([2, 1], 1) == [1, 0]
    assert sum(quotas([0.3, 0.3, 0.4], 7)) == 7


def test_sample_is_the_k_smallest_keys_in_key_order():
    records = [ChatRecord(str(i), "s", [Message("user", "x")]) for i in range(1000)]
    picked, seen = sample(iter(records), 50, random.Random(7))
    rng = random.Random(7)
    keys = [rng.random() for _ in records]
    expected = sorted(range(1000), key=lambda i: keys[i])[:50]
    assert seen == 1000 and [r.id for r in picked] == [str(i) for i in expected]


def test_mix_n_takes_each_share_without_replacement(tmp_path):
    a = _source(tmp_path / "a.jsonl", 200, "a")
    b = _source(tmp_path / "b.jsonl", 100, "b")
    stream, reports = mix([parse_source(f"{a}:3"), parse_source(f"{b}:1")], n=40, seed=1)
    ids = _ids(stream)
    assert len(ids) == len(set(ids)) == 40
    assert sum(i.startswith("a") for i in ids) == 30 and [r.quota for r in reports] == [30, 10]
    # smooth interleave: every window of 4 holds 3 from a and 1 from b
    assert all(sum(i.startswith("b") for i in ids[k:k + 4]) == 1 for k in range(0, 40, 4))


def test_mix_is_deterministic_for_a_seed(tmp_path):
    specs = [parse_source(str(_source(tmp_path / "a.jsonl", 300, "a")))]
    first = _ids(mix(specs, n=20, seed=5)[0])
    assert first == _ids(mix(specs, n=20, seed=5)[0])
    assert first != _ids(mix(specs, n=20, seed=6)[0])


def test_source_too_small_for_its_share(tmp_path):
    small = _source(tmp_path / "small.jsonl", 5, "s")
    specs = [parse_source(f"{small}:1")]
    with pytest.raises(InputError, match=r"small.jsonl: only 5 usable records, but its share "
                                         r"of -n 12 is 12; .*--allow-repeat"):
        list(mix(specs, n=12)[0])
    ids = _ids(mix(specs, n=12, allow_repeat=True)[0])
    # 12 = 2 x 5 + 2: every record twice, two of them (random) a third time
    assert sorted(collections.Counter(i.split("#")[0] for i in ids).values()) == [2, 2, 2, 3, 3]
    assert len(set(ids)) == 12  # repeats get #2, #3 suffixes


def test_without_n_every_record_once_interleaved_by_weight(tmp_path):
    a = _source(tmp_path / "a.jsonl", 6, "a")
    b = _source(tmp_path / "b.jsonl", 5, "b")
    ids = _ids(mix([parse_source(f"{a}:2"), parse_source(f"{b}:1")], n=None)[0])
    assert ids == ["a0", "b0", "a1", "a2", "b1", "a3", "a4", "b2", "a5", "b3", "b4"]


def test_interleave_keeps_going_when_a_source_runs_out():
    assert list(interleave([iter([1]), iter([2, 3, 4])], [5, 1])) == [1, 2, 3, 4]


def test_invalid_records_stop_or_are_counted(tmp_path):
    f = _source(tmp_path / "d.jsonl", 4, "d", bad_lines=(2,))
    with pytest.raises(InputError, match=r"d.jsonl:3: malformed JSON.*--skip-invalid"):
        list(mix([parse_source(str(f))], n=None)[0])
    stream, reports = mix([parse_source(str(f))], n=None, skip_invalid=True)
    assert len(_ids(stream)) == 4 and reports[0].invalid == {"malformed JSON": 1}


def test_empty_source_is_an_error(tmp_path):
    (tmp_path / "e.jsonl").write_text("\n")
    with pytest.raises(InputError, match="e.jsonl: no records"):
        list(mix([parse_source(str(tmp_path / "e.jsonl"))], n=None)[0])
    with pytest.raises(InputError, match="-n must be positive"):
        mix([parse_source(str(tmp_path / "e.jsonl"))], n=0)
