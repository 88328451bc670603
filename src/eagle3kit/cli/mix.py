"""`eagle3kit mix`: sample and normalise chat data sets into one JSONL stream."""

from __future__ import annotations

import contextlib
from pathlib import Path

import typer

from eagle3kit.cli._common import check_output, console, example, handle_errors, styled
from eagle3kit.errors import InputError, plural

EXAMPLE = """
eagle3kit mix sharegpt.json:0.45 ultrachat.jsonl:0.35 perfectblend.parquet:0.2 \\
  -n 54000 --seed 0 -o mixed.jsonl
eagle3kit mix hf:HuggingFaceH4/ultrachat_200k@train_sft -n 1000 | head -1
"""


@handle_errors
def mix(
    sources: list[str] = typer.Argument(..., metavar="SOURCE[:WEIGHT]...",
                                        help="A .jsonl, .json (array) or .parquet file, "
                                        "hf:NAME[:CONFIG]\\[@SPLIT], or - (JSONL on stdin); "
                                        "an optional :WEIGHT (default 1) sets its share."),
    n: int | None = typer.Option(None, "-n", help="Records to write, split by weight and "
                                 "sampled without replacement (default: every record once, "
                                 "interleaved by weight)."),
    seed: int = typer.Option(0, "--seed", min=0, max=2**32 - 1, help="Seed of the sampling (same seed and inputs "
                             "give byte-identical output)."),
    out: str = typer.Option("-", "-o", "--out", help="Output JSONL ('-' = stdout); a file is "
                            "written atomically."),
    fmt: str = typer.Option("auto", "--format", help="Record shape of every source: auto, "
                            "sharegpt, perfectblend, openai or ultrachat."),
    allow_repeat: bool = typer.Option(False, "--allow-repeat", help="Repeat the records of a "
                                      "source too small for its share instead of failing."),
    skip_invalid: bool = typer.Option(False, "--skip-invalid", help="Count and skip malformed "
                                      "records instead of stopping at the first."),
) -> None:
    """Mix chat data sets into normalised conversations (JSONL on stdout).

    Reads ShareGPT ("conversations"/"from"/"value"), OpenAI/UltraChat ("messages"/"role"/
    "content") and Open-PerfectBlend records and writes one schema: {"id", "source",
    "messages": [{"role": "system|user|assistant", "content"}]}. Conversations that cannot
    train a draft (no assistant turn, empty content) are dropped and counted on stderr. A
    .json file cut off mid-record yields every complete record; the tail is reported.
    """
    from eagle3kit.data.mixing import mix as run_mix
    from eagle3kit.data.records import encode
    from eagle3kit.data.sources import FORMATS, parse_source
    from eagle3kit.io.atomic import open_output

    if fmt not in FORMATS:
        raise typer.BadParameter(f"{fmt!r}; choose one of {', '.join(FORMATS)}",
                                 param_hint="--format")
    check_output(out, "-o")
    specs = [parse_source(s) for s in sources]
    for spec in specs:  # writing over a source would replace what is being read
        if not spec.location.startswith("hf:"):
            check_output(out, "-o", inputs={"SOURCE": spec.location})
    if sum(s.location == "-" for s in specs) > 1:
        raise typer.BadParameter("stdin (-) can be read only once", param_hint="SOURCE")
    status = console.status("reading") if console.is_terminal else contextlib.nullcontext()

    def progress(report) -> None:  # a live count on a terminal only
        if console.is_terminal:
            status.update(f"reading {report.spec.name}: {plural(report.read, 'record')}")

    stream, reports = run_mix(specs, n=n, seed=seed, fmt=fmt, allow_repeat=allow_repeat,
                              skip_invalid=skip_invalid, progress=progress)
    written = 0
    with status, open_output(None if out == "-" else Path(out), "wb") as f:
        for record in stream:
            f.write(encode(record))
            written += 1
        if written == 0:
            _report(reports, written)
            raise InputError("no usable conversations in the input; nothing written")
    _report(reports, written)


def _report(reports, written: int) -> None:
    for r in reports:
        for note in r.notes:
            console.print(styled("warning:", "yellow", f" {note}"))
        parts = [f"{r.used:,} of {r.read:,} usable"]
        if r.quota is not None:
            parts.append(f"{r.quota:,} sampled" + (f" ({r.repeated:,} repeats)"
                                                   if r.repeated else ""))
        parts += [f"{k}: {v:,} dropped" for k, v in sorted(r.dropped.items())]
        parts += [f"{k}: {v:,} skipped" for k, v in sorted(r.invalid.items())]
        console.print(styled(r.spec.name, "bold", f" (weight {r.spec.weight:g}): "
                             + ", ".join(parts)))
    console.print(f"wrote {plural(written, 'conversation')}")


mix.__doc__ = (mix.__doc__ or "") + example(EXAMPLE)
