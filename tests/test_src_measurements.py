"""No src comment or docstring quotes a measured rate or the GPU it was measured on: a number
in code goes stale the day the code or the machine changes, and nothing checks it. Code says
why it is as it is; the numbers live in docs/benchmarks.md with the run that made them
(issue 38)."""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

import eagle3kit

SRC = Path(eagle3kit.__file__).parent

NUMBER = r"\d+(?:[.,]\d+)*\s*[kKMG]?"
MEASURED = re.compile(
    rf"{NUMBER}\s*(?:tok/s|tokens?/s|tokens? per second|[GT]i?B/s|[TPG]FLOP/?s\b)"  # a rate
    rf"|{NUMBER}\s*(?:x|%)\s+(?:faster|slower|speedup|at\b|on\b|with\b)"  # a measured gain
    # where it was measured: a GPU named in prose, but for a fact of its design
    r"|(?<!per SM of an )\b(?:H100|H200|A100|B200)",
    re.IGNORECASE)


def prose(source: str) -> list[tuple[int, str]]:
    """(line, text) of every comment and docstring of a module's source."""
    out = [(t.start[0], t.string) for t in tokenize.generate_tokens(io.StringIO(source).readline)
           if t.type == tokenize.COMMENT]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
                    and isinstance(body[0].value.value, str):
                out.append((body[0].lineno, " ".join(body[0].value.value.split())))
    return out


def measurements(source: str) -> list[tuple[int, str]]:
    return [(line, m.group(0)) for line, text in prose(source)
            for m in MEASURED.finditer(" ".join(text.split()))]


def test_no_measured_rates_in_src_comments_or_docstrings():
    found = [f"{path.relative_to(SRC.parent)}:{line}: {quote!r}"
             for path in sorted(SRC.rglob("*.py"))
             for line, quote in measurements(path.read_text())]
    assert not found, ("measured numbers in src (say why instead; the number goes to "
                       "docs/benchmarks.md):\n" + "\n".join(found))


def test_the_pattern_catches_what_came_out_of_src_and_spares_what_stays():
    caught = [
        '"""(measured faster there: 129,020 against 37,281 tokens/s for SmolLM2 at 512 rows on an\n'
        '    H200, docs/benchmarks.md)"""\n',
        "# an 8B step runs 18.7k tok/s\n",
        "# reads 3.35 TB/s, 533 TFLOP/s\n",
        "# against XLA's matmuls: 64 rows 3.5% faster\n",
        "def f():\n    \"\"\"1.38x speedup at batch 8\"\"\"\n",
        "# the fastest of five settings on an H200 at H = 128\n",
        "# checks every 8 steps gave 1.38x at batch 8\n",
        "# q/k/v 27% -> 49% of an H100's bandwidth\n",
        "# which sliced (H100, the 8B shape)\n",
    ]
    for source in caught:
        assert measurements(source), source
    spared = [
        '"""step, epoch, loss, acc_0, tokens/s; `update` returns the measured tokens/s."""\n',
        "x = f'{rate:,.1f} tok/s'  # the rate as printed\n",
        "programs = 264  # two per SM of an H100\n",
        "# powers of two and 1.5x them: at most a third more than needed\n",
        'PEAK = {"NVIDIA H100": 989e12}  # the data sheet\'s dense bf16 peak\n',
    ]
    for source in spared:
        assert not measurements(source), source
