"""`eagle3kit mix` through the CLI: real ShareGPT records (the cut-off file included), the
three public formats mixed by weight, stdin, determinism, and bad input."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from eagle3kit.cli.app import app
from eagle3kit.data.records import ChatRecord, read_chat_records
from tests.data import real_data

runner = CliRunner()

ULTRACHAT = [{"prompt": f"q{i}", "prompt_id": f"u{i}", "messages": [
    {"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"a{i}"}]}
    for i in range(40)]
BLEND = [{"conversations": [{"from": "human", "value": f"b{i}"}, {"from": "gpt", "value": "ok"}],
          "source": "slimorca"} for i in range(40)]


def lines_of(text: str) -> list[str]:
    # not str.splitlines: JSON strings may hold U+2028 and other characters it splits on
    return text.split("\n")[:-1]


def mix(*args, input=None):
    # wide: typer's error box would otherwise wrap messages mid-phrase
    return runner.invoke(app, ["mix", *map(str, args)], input=input, env={"COLUMNS": "250"})


@pytest.fixture(scope="module")
def sharegpt():
    return real_data.sharegpt_array(300)


@pytest.fixture()
def three(tmp_path, sharegpt):
    u = tmp_path / "ultrachat.jsonl"
    u.write_text("".join(json.dumps(r) + "\n" for r in ULTRACHAT))
    p = tmp_path / "perfectblend.parquet"
    pq.write_table(pa.Table.from_pylist(BLEND), p)
    return [f"{sharegpt}:0.45", f"{u}:0.35", f"{p}:0.2"]


def test_mix_three_formats_by_weight(three, tmp_path):
    out = tmp_path / "mixed.jsonl"
    r = mix(*three, "-n", 40, "--seed", 0, "-o", out)
    assert r.exit_code == 0, r.output
    records = list(read_chat_records(out))
    sources = [rec.source for rec in records]
    assert len(records) == 40 and len({rec.id for rec in records}) == 40
    assert [sources.count(s) for s in ("sharegpt_300.json", "ultrachat.jsonl",
                                       "perfectblend.parquet")] == [18, 14, 8]
    assert all(m.role in ("system", "user", "assistant") and m.content
               for rec in records for m in rec.messages)
    assert "sharegpt_300.json (weight 0.45):" in r.stderr and "wrote 40 conversations" in r.stderr


def test_same_seed_same_bytes(three, tmp_path):
    outs = []
    for seed in (3, 3, 4):
        outs.append(tmp_path / f"o{len(outs)}.jsonl")
        assert mix(*three, "-n", 30, "--seed", seed, "-o", outs[-1]).exit_code == 0
    assert outs[0].read_bytes() == outs[1].read_bytes() != outs[2].read_bytes()


def test_stdout_and_stdin(sharegpt):
    r = mix(sharegpt, "-n", 5)
    assert r.exit_code == 0, r.output
    lines = lines_of(r.stdout)
    assert len(lines) == 5 and "wrote 5" not in r.stdout  # humans' output stays on stderr
    again = mix("-", "-n", 3, input=r.stdout)
    assert again.exit_code == 0, again.output
    assert [json.loads(x)["source"] for x in lines_of(again.stdout)] == ["stdin"] * 3


def test_without_n_every_usable_record_once(sharegpt):
    r = mix(sharegpt)
    assert r.exit_code == 0, r.output
    ids = [json.loads(x)["id"] for x in lines_of(r.stdout)]
    raw = json.loads(sharegpt.read_text())
    assert len(ids) == len(set(ids)) < len(raw)
    assert "dropped" in r.stderr  # the real sample holds empty conversations


@pytest.mark.slow
def test_real_cut_off_sharegpt_file(sharegpt_path):
    r = mix(sharegpt_path, "-n", 10, "--seed", 1)
    assert r.exit_code == 0, r.output
    assert "17,671 complete records read" in r.stderr and "last 2,987 bytes" in r.stderr
    assert "17,458 of 17,671 usable" in r.stderr and len(lines_of(r.stdout)) == 10
    ChatRecord(**json.loads(lines_of(r.stdout)[0]))


def _bad_cases(tmp_path):
    good = tmp_path / "good.jsonl"
    good.write_text(json.dumps(ULTRACHAT[0]) + "\n")
    malformed = tmp_path / "malformed.jsonl"
    malformed.write_text(json.dumps(ULTRACHAT[0]) + "\n" + '{"messages": [\n')
    shape = tmp_path / "shape.jsonl"
    shape.write_text('{"text": "no conversation"}\n')
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    parquet = tmp_path / "broken.parquet"
    parquet.write_bytes(b"not parquet at all")
    return {
        "malformed": ([malformed], f"{malformed}:2: malformed JSON"),
        "shape": ([shape], f"{shape}:1: unknown record shape"),
        "missing": ([tmp_path / "nope.json"], "nope.json: no such file"),
        "empty": ([empty], f"{empty}: no records"),
        "weight": ([f"{good}:0"], "weight must be a positive number"),
        "parquet": ([parquet], f"{parquet}: not a readable parquet file"),
        "too small": ([good, "-n", 5], "only 1 usable record, but its share of -n 5 is 5"),
    }


@pytest.mark.parametrize("case", ["malformed", "shape", "missing", "empty", "weight",
                                  "parquet", "too small"])
def test_bad_input_one_error_line_no_output(tmp_path, case):
    args, message = _bad_cases(tmp_path)[case]
    out = tmp_path / "out" / "mixed.jsonl"
    r = mix(*args, "-o", out)
    assert r.exit_code == 2 and message in r.stderr, r.output
    assert r.stderr.count("error:") == 1
    assert not out.exists()
    assert not out.parent.exists() or not any(out.parent.iterdir())  # no temporary left


def test_skip_invalid_counts(tmp_path):
    f = tmp_path / "d.jsonl"
    f.write_text("\n".join([json.dumps(ULTRACHAT[0]), "{broken", '{"text": 1}',
                            json.dumps(ULTRACHAT[1])]) + "\n")
    r = mix(f, "--skip-invalid")
    assert r.exit_code == 0, r.output
    assert len(lines_of(r.stdout)) == 2
    assert "malformed JSON: 1 skipped" in r.stderr and "unknown record shape: 1 skipped" in r.stderr


def test_bad_options(sharegpt):
    assert "--format" in mix(sharegpt, "--format", "csv").stderr
    assert mix(sharegpt, "--format", "csv").exit_code == 2
    r = mix("-", "-", input="")
    assert r.exit_code == 2 and "stdin (-) can be read only once" in r.stderr


def test_help_ends_with_a_runnable_example():
    r = runner.invoke(app, ["mix", "--help"])
    assert r.exit_code == 0 and "Example:" in r.stdout and "eagle3kit mix sharegpt.json" in r.stdout


def test_one_record_is_one_conversation(tmp_path):
    """Counts of one read as one: `wrote 1 conversation`, not `1 conversations` (issue 24)."""
    f = tmp_path / "one.jsonl"
    f.write_text(json.dumps(ULTRACHAT[0]) + "\n")
    r = mix(f)
    assert r.exit_code == 0 and len(lines_of(r.stdout)) == 1, r.output
    assert r.stderr.splitlines()[-1] == "wrote 1 conversation", r.stderr
