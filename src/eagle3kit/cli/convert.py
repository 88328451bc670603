"""`eagle3kit convert`: a draft in, the same draft out in another format."""

from __future__ import annotations

import logging
from pathlib import Path

import typer

from eagle3kit.cli._common import (
    check_output,
    console,
    example,
    handle_errors,
    no_stdout,
    styled,
)
from eagle3kit.errors import UserError
from eagle3kit.formats import registry

EXAMPLE = """
eagle3kit convert runs/smollm2/final --to sglang -o export/sglang \\
  --target-name HuggingFaceTB/SmolLM2-135M-Instruct
eagle3kit convert runs/smollm2/final --to speculators -o export/vllm \\
  --target-name HuggingFaceTB/SmolLM2-135M-Instruct
eagle3kit convert ORG/Llama-3.1-8B-Eagle3 --to eagle3kit -o imported \\
  --target meta-llama/Llama-3.1-8B-Instruct
"""

# the registered formats when the CLI was built, for --help (the checks below ask the registry)
_KNOWN = registry.names()
_DISPLAYS = [f.display for f in registry.formats()]


class _ConsoleHandler(logging.Handler):
    """Library warnings (eagle3kit.formats) as yellow lines on stderr."""

    def emit(self, record: logging.LogRecord) -> None:
        console.print(styled("warning:", "yellow", f" {record.getMessage()}"))


def route_warnings() -> None:
    """Shows eagle3kit's library warnings on the stderr console, once per process."""
    logger = logging.getLogger("eagle3kit")
    if not any(isinstance(h, _ConsoleHandler) for h in logger.handlers):
        logger.addHandler(_ConsoleHandler(logging.WARNING))
        logger.propagate = False


def _check_choice(value: str, choices: tuple[str, ...], hint: str) -> str:
    if value not in choices:
        raise typer.BadParameter(f"{value!r}; choose one of {', '.join(choices)}",
                                 param_hint=hint)
    return value


@handle_errors
def convert(
    source: str = typer.Argument(..., help=f"Draft directory or Hub id "
                                 f"({registry.spoken(_DISPLAYS)} format, detected "
                                 "automatically)."),
    to: str = typer.Option(..., "--to", help=f"Output format: {registry.spoken(_KNOWN)}."),
    out: Path = typer.Option(..., "-o", "--out", help="Output directory (must not exist)."),
    dtype: str = typer.Option("bfloat16", help="Weights of engine formats: bfloat16, float16 "
                              "or float32 (eagle3kit format always keeps float32)."),
    target: str | None = typer.Option(None, help="The target model (directory, .gguf or Hub "
                                      "id), when the source does not record it (SGLang "
                                      "drafts never do)."),
    target_name: str | None = typer.Option(None, help="Hub id of the target to record (the "
                                           "verifier vLLM loads, the card's base_model), e.g. "
                                           "when training used a local copy."),
    speculative_tokens: int = typer.Option(3, min=1, max=64, help="Draft tokens per step recorded in "
                                           "the speculators config (vLLM's default)."),
    source_format: str = typer.Option("auto", "--from", help="Source format when detection "
                                      f"is ambiguous: {registry.spoken(_KNOWN)}."),
    force: bool = typer.Option(False, "--force", help="Replace an existing output directory "
                               "that holds an earlier export (and nothing else)."),
) -> None:
    """Engine exports are checked before anything is written: capture layers
    that fit the target, vocab sizes that agree, d2t present and valid,
    finite weights. They carry every config field the engines read
    (max_position_embeddings and rope from the target, capture layers in
    each engine's own convention) and an eagle3kit.json sidecar that `push`
    turns into the model card. The output appears complete or not at all.
    Imports take a directory or Hub id in any format (auto-detected).
    """
    from eagle3kit.formats import check_replaceable, common, export_draft, load_any_draft

    route_warnings()
    _check_choice(to, registry.names(), "--to")
    _check_choice(source_format, ("auto", *registry.names()), "--from")
    dtype = common.dtype_name(dtype)
    no_stdout(out, "-o", "an export (a directory of files)")
    check_output(out, "-o", "replace")
    if out.exists() and not force:
        raise UserError("already exists (pass --force to replace it)", path=out)
    check_replaceable(out, source)
    draft = load_any_draft(source, target=target, target_name=target_name, fmt=source_format)
    cfg = draft.config
    console.print(f"read {source}: draft for {draft.target_name or '?'}, "
                  f"hidden {cfg.hidden_size}, draft vocab {cfg.draft_vocab_size:,}/"
                  f"{cfg.vocab_size:,}, layers {list(cfg.aux_layer_ids)}")
    path = export_draft(draft, to, out, dtype=dtype, force=force,
                        speculative_tokens=speculative_tokens, source=source)
    size = sum(p.stat().st_size for p in path.iterdir() if p.is_file())
    what = registry.get(to).dtype or dtype
    console.print(f"wrote {path} ({to} format, {what}, {size / 1e6:.1f} MB)")


convert.__doc__ = (f"Convert a draft between {registry.spoken(_DISPLAYS, 'and')} formats.\n\n"
                   f"    {convert.__doc__}" + example(EXAMPLE))
