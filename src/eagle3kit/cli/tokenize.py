"""`eagle3kit tokenize`: render conversations with the target's chat template, with loss masks."""

from __future__ import annotations

import time

import typer

from eagle3kit.cli._common import (
    check_output,
    console,
    example,
    handle_errors,
    require_files,
)
from eagle3kit.cli._params import ChatTemplate
from eagle3kit.errors import InputError, UserError, plural

EXAMPLE = """
eagle3kit mix sharegpt.json -n 1000 \\
  | eagle3kit tokenize --tokenizer HuggingFaceTB/SmolLM2-135M-Instruct --max-length 2048 \\
  > train.jsonl
eagle3kit tokenize --tokenizer Qwen/Qwen3-8B --no-thinking -i mixed.jsonl -o train.jsonl -j 16
"""


@handle_errors
def tokenize(
    tokenizer: str = typer.Option(..., "--tokenizer", "-t", help="The target's tokenizer: a "
                                  "local directory, a .gguf file or a Hub id."),
    input: str = typer.Option("-", "-i", "--input", help="Chat records (JSONL, from `mix`); "
                              "'-' = stdin."),
    out: str = typer.Option("-", "-o", "--out", help="Token records (JSONL); '-' = stdout; a "
                            "file is written atomically."),
    max_length: int = typer.Option(2048, "--max-length", min=1, help="Truncate each "
                                   "conversation to this many tokens."),
    chat_template: ChatTemplate = None,
    thinking: bool | None = typer.Option(None, "--thinking/--no-thinking", help="Qwen3-style "
                                         "templates: render for thinking mode (the think block "
                                         "is generated, so it is learned) or non-thinking mode "
                                         "(it is part of the prompt). Default: the template's."),
    jobs: int | None = typer.Option(None, "-j", "--jobs", min=1, help="Worker processes "
                                    "(default: every core)."),
    skip_invalid: bool = typer.Option(False, "--skip-invalid", help="Count and skip malformed "
                                      "lines instead of stopping at the first."),
) -> None:
    """Tokenize conversations into token records with assistant loss masks.

    Writes {"id", "input_ids", "loss_mask", "tokenizer"} per conversation. The mask is 1 on
    exactly the tokens the target generates: every assistant turn's content and its
    end-of-turn token; never system or user turns or template scaffolding. "tokenizer" is the
    tokenizer's fingerprint; `vocab-select`, `train` and `eval` refuse data whose fingerprint
    differs from theirs. Conversations the template cannot render faithfully, or with no
    assistant token left after --max-length, are dropped and counted on stderr.
    """
    from eagle3kit.data.fingerprint import tokenizer_fingerprint
    from eagle3kit.data.records import display_name, iter_lines
    from eagle3kit.data.tokenizer import load_chat_template, load_tokenizer, tokenizer_name
    from eagle3kit.data.tokenizing import (
        Job,
        TokenizeReport,
        default_jobs,
        make_renderer,
        tokenize_lines,
    )
    from eagle3kit.io.atomic import open_output

    require_files(input=input)  # and the template (a file or a name) before the tokenizer
    check_output(out, "-o", inputs={"-i": input})
    if jobs is not None and jobs > 4 * default_jobs():  # each worker holds a tokenizer
        raise UserError(f"-j {jobs}: more than 4 worker processes per core ("
                        f"{plural(default_jobs(), 'core')} here); give at most "
                        f"{4 * default_jobs()}")
    if chat_template:
        load_chat_template(chat_template)  # a file that is no template fails before loading
    with console.status(f"loading tokenizer {tokenizer}"):
        tok = load_tokenizer(tokenizer)
    renderer = make_renderer(tok, chat_template, thinking, tokenizer)  # checks the template
    template = renderer.template
    fp = tokenizer_fingerprint(tok, tokenizer_name(tokenizer), renderer.template)
    jobs = jobs or default_jobs()
    console.print(f"tokenizer {fp.name} ({fp.vocab_size:,} tokens, fingerprint {fp.key}), "
                  f"{plural(jobs, 'job')}")
    job = Job(tok, fp.key, display_name(input), max_length, template, thinking)
    report = TokenizeReport()
    start = time.perf_counter()
    with _progress() as advance, open_output(None if out == "-" else out, "wb") as f:
        for line in tokenize_lines(iter_lines(input), job, jobs=jobs, skip_invalid=skip_invalid,
                                   report=report, progress=advance):
            f.write(line)
        if report.records == 0:
            raise InputError("no chat records (empty input)", path=display_name(input))
        if report.written == 0:
            _report(report, time.perf_counter() - start)
            raise InputError("no conversation yielded a token record; nothing written",
                             path=display_name(input))
    _report(report, time.perf_counter() - start)


class _progress:
    """A live count on a terminal; in logs a plain line every PROGRESS_SECONDS."""

    def __enter__(self):
        from eagle3kit.jobs.progress import Progress

        self.done = 0
        self.bar = Progress(console, "tokenize: conversations", every=None,
                            seconds=PROGRESS_SECONDS)
        self.bar.__enter__()
        return self.advance

    def advance(self, n: int) -> None:
        self.done += n
        self.bar.update(self.done, info="")

    def __exit__(self, *exc):
        self.bar.__exit__(*exc)


PROGRESS_SECONDS = 30.0


def _report(r, seconds: float) -> None:
    rate = r.records / seconds if seconds > 0 else 0.0
    console.print(f"{r.written:,} of {plural(r.records, 'conversation')} written "
                  f"({rate:,.0f}/s), {plural(r.tokens, 'token')}, {r.masked:,} masked "
                  f"({r.masked / max(r.tokens, 1):.1%}); {r.truncated:,} truncated")
    for reason, count in sorted(r.dropped.items()):
        console.print(f"  dropped {count:,}: {reason}")
    for reason, count in sorted(r.invalid.items()):
        console.print(f"  skipped {count:,} invalid: {reason}")


tokenize.__doc__ = (tokenize.__doc__ or "") + example(EXAMPLE)
