"""Documentation that users meet: every command's help ends with a runnable example, and the
README's two set-up commands are the ones the Makefile and CI run."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from typer.testing import CliRunner

from eagle3kit.cli.app import app

ROOT = Path(__file__).resolve().parent.parent
COMMANDS = ["mix", "tokenize", "vocab-select", "regenerate", "train", "eval", "convert",
            "push", "assets"]


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


def _readme_commands() -> list[str]:
    """The README's first example block, one command per element (continuations joined)."""
    lines, block = (ROOT / "README.md").read_text().splitlines(), []
    start = next(i for i, line in enumerate(lines) if line.startswith("    eagle3kit")
                 or line.startswith("    set -o"))
    for line in lines[start:]:
        if not line.startswith("    "):
            break
        block.append(line.strip())
    return " ".join(block).replace("\\ ", "").replace(" | ", " |\n").split("\n")


def test_readme_pipeline_runs_under_pipefail_and_train_reads_what_it_wrote():
    text = "\n".join(_readme_commands())
    assert text.startswith("set -o pipefail")
    commands = re.split(r"(?= eagle3kit (?:train|eval|convert|push) )", text)
    written = set(re.findall(r"(?:tee|-o) (\S+)", commands[0]))
    train = next(c for c in commands if c.startswith(" eagle3kit train"))
    for option in ("--data", "--vocab", "--eval-data"):
        for path in re.findall(rf"{option} (\S+)", train):
            assert path in written, f"README: train {option} {path} is not made by the pipeline"


def test_documents_point_only_at_files_in_the_repository():
    sources = [ROOT / "README.md", *(ROOT / "docs").glob("*.md"),
               *(f for f in (ROOT / "examples").rglob("*") if f.is_file())]
    for source in sources:
        text = source.read_text()
        assert "../shared" not in text and "/work/shared" not in text, source
        if source.suffix == ".md":  # link targets
            refs = re.findall(r"\]\(([^)#:]+)\)", text)
        else:  # documents named in a script's comments
            comments = "\n".join(x for x in text.splitlines() if x.lstrip().startswith("#"))
            refs = re.findall(r"[\w./-]+\.md\b", comments)
        for ref in refs:
            assert (source.parent / ref).exists() or (ROOT / ref).exists(), (source, ref)


def test_readme_says_how_to_run_the_command_and_every_exit_code():
    """A new user learns where the command is, what `make install` does, which extra --track
    needs, and every exit code a command can end with (issue 24, item 10)."""
    import importlib
    import pkgutil

    import eagle3kit
    from eagle3kit.errors import UserError

    readme = " ".join((ROOT / "README.md").read_text().split())
    for words in ("source .venv/bin/activate", ".venv/bin/eagle3kit", "make install",
                  "'.[track]'"):
        assert words in readme, words
    for m in pkgutil.walk_packages(eagle3kit.__path__, "eagle3kit."):
        if not m.name.endswith("__main__"):  # which would run the command line
            importlib.import_module(m.name)

    def classes(c):
        return [c, *(s for sub in c.__subclasses__() for s in classes(sub))]

    codes = {c.exit_code for c in classes(UserError)} | {130, 143}  # Ctrl-C and SIGTERM
    listed = readme.split("a non-zero exit (", 1)[1].split(").", 1)[0]
    for code in sorted(codes):
        assert re.search(rf"\b{code} ", listed), f"exit code {code} missing from {listed!r}"
