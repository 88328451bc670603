"""The eagle3kit command line: one line per subcommand, in pipeline order."""

from __future__ import annotations

import os

import typer

from eagle3kit import __version__
from eagle3kit.cli._common import Group

# transformers warns on import that "PyTorch was not found"; no command needs torch (GGUF
# tokenizers are read without it), so the advice is noise on every tokenizer-loading command
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

app = typer.Typer(
    name="eagle3kit",
    cls=Group,  # our error lines for usage errors, help not cut at 80 columns in pipes
    help="Train EAGLE3 speculative-decoding draft heads in pure JAX.\n\n"
    "Pipeline: mix [| regenerate] | tokenize | vocab-select, then train, eval, convert, push.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"eagle3kit {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    debug: bool = typer.Option(False, "--debug", help="Show tracebacks on errors."),
    version: bool = typer.Option(False, "--version", callback=_version, is_eager=True,
                                 help="Print the version and exit."),
) -> None:
    if debug:
        os.environ["EAGLE3KIT_DEBUG"] = "1"


# ---- the commands, in pipeline order (one line each) ----
from eagle3kit.cli import mix, tokenize, vocab_select  # noqa: E402, I001
app.command("mix")(mix.mix)
app.command("tokenize")(tokenize.tokenize)
app.command("vocab-select")(vocab_select.vocab_select)
from eagle3kit.cli import regenerate  # noqa: E402

app.command("regenerate")(regenerate.regenerate)
from eagle3kit.cli import train  # noqa: E402

app.command("train")(train.train)
from eagle3kit.cli import eval as eval_cli  # noqa: E402, I001
app.command("eval")(eval_cli.eval_cmd)
from eagle3kit.cli import convert, push  # noqa: E402, I001
app.command("convert")(convert.convert)
app.command("push")(push.push)
from eagle3kit.cli import assets  # noqa: E402, I001
app.command("assets")(assets.assets)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
