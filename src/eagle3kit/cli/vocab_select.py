"""`eagle3kit vocab-select`: the draft vocabulary (d2t / t2d) from token records."""

from __future__ import annotations

import sys

import typer

from eagle3kit.cli._common import (
    check_output,
    console,
    example,
    handle_errors,
    require_files,
    styled,
)
from eagle3kit.errors import UserError, plural

EXAMPLE = """
eagle3kit tokenize --tokenizer HuggingFaceTB/SmolLM2-135M-Instruct -i mixed.jsonl \\
  | tee train.jsonl | eagle3kit vocab-select --size 32000 -o vocab.safetensors
"""


@handle_errors
def vocab_select(
    size: int = typer.Option(32000, "--size", min=1, help="Draft vocab size Vd."),
    input: str = typer.Option("-", "-i", "--input", help="Token records (JSONL, from "
                              "`tokenize`); '-' = stdin."),
    out: str = typer.Option(..., "-o", "--out", help="Vocab file (safetensors), written "
                            "atomically; '-' = stdout (not a terminal)."),
    tokenizer: str | None = typer.Option(None, "--tokenizer", help="Optional: the target's "
                                         "tokenizer; refuse data made by another one, and "
                                         "record its name."),
) -> None:
    """Choose the Vd most frequent assistant tokens as the draft vocabulary.

    Counts loss-masked tokens only, takes the top --size by (count desc, id asc) and, when
    fewer distinct tokens occur, fills with the lowest unused ids (and says so). Writes
    safetensors with d2t (int64 offsets [Vd]: draft id i is target id i + d2t[i]) and t2d
    (bool [V]), and metadata: the tokenizer fingerprint, sizes, and the token coverage (the
    share of masked tokens inside the draft vocab).
    """
    from eagle3kit.data.counting import count_masked, select
    from eagle3kit.data.fingerprint import Fingerprint, parse_key, tokenizer_fingerprint
    from eagle3kit.data.records import display_name
    from eagle3kit.io.draft_io import write_vocab

    require_files(input=input)
    check_output(out, "-o", inputs={"-i": input})
    if out == "-" and sys.stdout.isatty():
        raise UserError("-o -: a vocab file is binary safetensors; redirect stdout to a file "
                        "or pipe, or give a file name")
    fingerprint = None
    if tokenizer is not None:
        from eagle3kit.data.tokenizer import load_tokenizer, tokenizer_name

        fingerprint = tokenizer_fingerprint(load_tokenizer(tokenizer), tokenizer_name(tokenizer))
    counts = count_masked(input, fingerprint.key if fingerprint else None)
    if fingerprint is None:  # the records carry the key only: vocab size and digest
        vocab_size, digest = parse_key(counts.key, display_name(input))
        fingerprint = Fingerprint(name="", vocab_size=vocab_size, digest=digest)
    chosen = select(counts, size)
    write_vocab(out, chosen.vocab, chosen.metadata(fingerprint))
    console.print(f"{plural(counts.records, 'record')}, {plural(chosen.masked, 'masked token')}, "
                  f"{int((counts.counts > 0).sum()):,} distinct")
    if chosen.filled:
        console.print(styled("warning:", "yellow", f" only {size - chosen.filled:,} distinct "
                      f"tokens occur in the masked data; filled {chosen.filled:,} draft ids "
                      "with the lowest unused token ids"))
    console.print(f"draft vocab {chosen.vocab.draft_size:,} of {chosen.vocab.target_size:,}: "
                  f"coverage {chosen.coverage:.2%} of masked tokens -> {'stdout' if out == '-' else out}")


vocab_select.__doc__ = (vocab_select.__doc__ or "") + example(EXAMPLE)
