"""Every command's error path with odd file names: `[x]` (Rich markup), `:-1:` (an emoji code),
spaces and unicode come back exactly as given, in one `error:` line, with nothing written."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from eagle3kit.cli.app import app

runner = CliRunner()
ODD = ["missing[bold].jsonl", "a[/x]b.jsonl", "f:-1:.jsonl", "with space é.jsonl", "[red]x"]


def commands(name: str) -> dict[str, list[str]]:
    return {
        "mix": ["mix", name],
        "tokenize": ["tokenize", "--tokenizer", "org/never-loaded", "-i", name],
        "vocab-select": ["vocab-select", "-i", name, "-o", "v.safetensors"],
        "train": ["train", "--target", "org/never-loaded", "--data", name, "--vocab", name,
                  "--out", "run"],
        "eval": ["eval", "--target", "org/never-loaded", "--draft", "d", "--data", name],
        "convert": ["convert", name, "--to", "sglang", "-o", "out"],
        "push": ["push", name, "--repo-id", "org/x", "--dry-run"],
    }


@pytest.mark.parametrize("name", ODD)
def test_odd_names_through_every_error_path(name, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for command, args in commands(name).items():
        r = runner.invoke(app, args, env={"COLUMNS": "80"})
        lines = r.output.strip().splitlines()
        assert r.exit_code == 2, (command, r.output)
        assert len(lines) == 1 and lines[0].startswith(f"error: {name}: "), (command, r.output)
        assert list(tmp_path.iterdir()) == [], command


def test_odd_names_in_file_contents_and_line_numbers(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    name = "[bold]:-1:.jsonl"
    (tmp_path / name).write_text('{"id": "[/x]", "conversations": 7}\n')
    r = runner.invoke(app, ["mix", name])
    assert r.exit_code == 2 and r.output.startswith(f"error: {name}:1: "), r.output
