"""Documentation that users meet: every command's help ends with a runnable example, and the
README's two set-up commands are the ones the Makefile and CI run."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from eagle3kit.cli.app import app

ROOT = Path(__file__).resolve().parent.parent
COMMANDS = ["mix", "tokenize", "vocab-select", "train", "eval", "convert", "push"]


def test_every_command_is_registered_in_pipeline_order():
    names = [c.name for c in app.registered_commands]
    assert names == COMMANDS


@pytest.mark.parametrize("command", COMMANDS)
def test_help_ends_with_a_runnable_example(command):
    result = CliRunner().invoke(app, [command, "--help"], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    text = result.output
    assert "Example" in text and f"eagle3kit {command}" in text.split("Example", 1)[1]


def test_readme_two_commands_are_what_ci_runs():
    readme = (ROOT / "README.md").read_text()
    assert "make demo" in readme and "make test" in readme
    assert "make test" in (ROOT / ".ci" / "run").read_text()
    makefile = (ROOT / "Makefile").read_text()
    assert "\ndemo:" in makefile and "\ntest:" in makefile
    assert (ROOT / "examples" / "smollm2_sharegpt.sh").exists()
