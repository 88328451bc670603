"""The recipes in examples/ (recipe.mk and the Llama-3.1 and Qwen3 Makefiles) run end to end at
toy scale, and `make -n` at full scale prints the commands a user runs on the real models.

Toy scale: a tiny random model of the target's architecture (Llama-3.1 with llama3 rope
scaling; Qwen3 with q/k norms and tied embeddings) saved as a Hugging Face directory with the
real chat template, tiny files in the three public data sets' schemas (ShareGPT JSON,
UltraChat JSONL, Open-PerfectBlend parquet), and the recipe's own rules with small sizes.
Llama runs v1, Qwen3 runs v2 (regenerated, non-thinking data), so every target runs once;
the generation eval of a prompt set runs in the Qwen3 run only (each is a minute of CPU).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import typer.main

from eagle3kit.cli.app import app
from eagle3kit.data.records import read_chat_records, read_token_records
from tests import assets, warm_cli
from tests.data import chat_tokenizers

ROOT = Path(__file__).resolve().parents[2]
RECIPES = {"llama": ROOT / "examples" / "llama-3.1-8b-instruct" / "Makefile",
           "qwen3": ROOT / "examples" / "qwen3-8b" / "Makefile"}
TOKENIZERS = {"llama": "llama3", "qwen3": "qwen3"}
HUB_IDS = {"llama": "meta-llama/Llama-3.1-8B-Instruct", "qwen3": "Qwen/Qwen3-8B"}

TOPICS = ["the sea", "prime numbers", "bread", "a small robot", "rain", "chess", "tea", "maps"]


def conversation(i: int) -> list[tuple[str, str]]:
    topic = TOPICS[i % len(TOPICS)]
    turns = [("user", f"Tell me one fact about {topic}."),
             ("assistant", f"Here is one fact about {topic}: it is often discussed.")]
    if i % 3 == 0:
        turns += [("user", "Another?"), ("assistant", f"Also, {topic} appears in stories.")]
    return turns


@pytest.fixture(scope="module")
def toy_data(tmp_path_factory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("data")
    sharegpt = [{"id": f"sg{i}", "conversations": [
        {"from": {"user": "human", "assistant": "gpt"}[r], "value": t}
        for r, t in conversation(i)]} for i in range(16)]
    (d / "sharegpt.json").write_text(json.dumps(sharegpt, indent=1))
    ultrachat = [{"prompt": conversation(i)[0][1], "prompt_id": f"uc{i}", "messages": [
        {"role": r, "content": t} for r, t in conversation(i)]} for i in range(16, 28)]
    (d / "ultrachat.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ultrachat))
    blend = [{"conversations": [{"from": {"user": "human", "assistant": "gpt"}[r], "value": t}
                                for r, t in conversation(i)], "source": "slimorca"}
             for i in range(28, 36)]
    pq.write_table(pa.Table.from_pylist(blend), d / "perfectblend.parquet")
    return {"SHAREGPT": d / "sharegpt.json", "ULTRACHAT": d / "ultrachat.jsonl",
            "PERFECTBLEND": d / "perfectblend.parquet"}


def tiny_target(family: str, directory: Path) -> Path:
    """The architecture of the real target at toy width, with the real chat template."""
    tok_dir = chat_tokenizers.saved(TOKENIZERS[family])
    size = len(chat_tokenizers.__dict__[TOKENIZERS[family]]())
    saved = dict(assets.TINY[family])
    assets.TINY[family] = {**saved, "vocab_size": size, "num_hidden_layers": 8,
                           "max_position_embeddings": 512}
    try:
        assets.tiny_hf_model(family, directory)
    finally:
        assets.TINY[family] = saved
    for f in tok_dir.iterdir():
        shutil.copy(f, directory / f.name)
    return directory


@pytest.fixture(scope="module")
def e3k(eagle3kit_server):
    """E3K for the toy runs: each command forked from a server that imported eagle3kit once
    (conftest's eagle3kit_server), instead of a fresh `python -m eagle3kit` each."""
    return f"{shlex.quote(sys.executable)} -I {shlex.quote(warm_cli.__file__)} " \
           f"{eagle3kit_server.sock}"


def make(family: str, *args: str, **variables) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": f"{ROOT / 'src'}{os.pathsep}{ROOT}"}
    cmd = ["make", "--no-print-directory", "-f", str(RECIPES[family]), *args,
           *(f"{k}={v}" for k, v in variables.items())]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)


def toy(family: str, target: Path, out: Path, data: dict[str, Path], e3k: str, **extra) -> dict:
    """The recipe's variables at toy scale; everything else is the recipe's own."""
    return {"TARGET": target, "TARGET_NAME": HUB_IDS[family], "OUT": out, "E3K": e3k, **data,
            "RECORDS": 30, "TOKENIZE_JOBS": 1, "MAX_STEPS": 4, "HELDOUT_EVERY": 6, "SEQ_LEN": 128, "VOCAB_SIZE": 256,
            "EPOCHS": 1, "BATCH": 2, "GRAD_ACCUM": 1, "TTT": 2, "DTYPE": "float32",
            "TARGET_DTYPE": "float32", "TRAIN_FLAGS": "--log-every 1 --eval-every 1000",
            "PROMPT_LIMIT": 1, "NEW_TOKENS": 6, "EVAL_BATCH": 2, "REGEN_MAX_NEW_TOKENS": 12,
            "REGEN_MAX_CONTEXT": 256, "REGEN_SLOTS": 4, "PUSH_FLAGS": "--dry-run",
            "REPO_ID": f"toy/{family}-eagle3", **extra}


def ok(r: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert r.returncode == 0, f"{r.args}\n--- stdout\n{r.stdout[-4000:]}\n--- stderr\n" \
                              f"{r.stderr[-6000:]}"
    return r


def check_card(card: str, family: str, prompt_sets: tuple[str, ...] = ()) -> None:
    assert f"base_model: {HUB_IDS[family]}" in card
    # MAX_STEPS 4 stops the run inside its one epoch: the card says so (issue 39, item 9)
    assert re.search(r"\| Epochs \| (1|0\.\d+ of the 1 planned \(stopped by --max-steps "
                     r"at step 4 of \d+\)) \|", card), card
    for row in ("| Optimizer steps | 4 |", "| TTT length | 2 steps", "| Batch | B=2, sequence length "
                "T=128, gradient accumulation 1 |", "| Learning rate | 0.0003 peak"):
        assert row in card, row
    # one acceptance row per eval file the recipe wrote
    assert "| heldout.jsonl (teacher-forced) |" in card
    assert re.search(r"\| Recipe \| examples/[\w.-]+/Makefile VERSION=v[12] \|", card), card
    for p in prompt_sets:  # a generation row names its drafting shape (the recipe's chain)
        assert re.search(rf"\| {re.escape(p)}, chain K=\d+ \|", card), p
    assert "python -m sglang.launch_server" in card and "vllm serve" in card
    assert "## Limitations" in card


def test_llama_v1_end_to_end_and_resumable(toy_data, e3k, tmp_path):
    target = tiny_target("llama", tmp_path / "target")
    out = tmp_path / "run"
    # no prompt set here (the Qwen3 run decodes MT-bench): the teacher-forced eval only
    variables = toy("llama", target, out, toy_data, e3k, PROMPT_SETS="")
    r = ok(make("llama", "-j2", "all", **variables))
    v1 = out / "v1"
    held = [c.id for c in read_chat_records(out / "chats" / "heldout.jsonl")]
    assert len(held) == 30 // 6
    assert not set(held) & {c.id for c in read_chat_records(out / "chats" / "train.jsonl")}
    assert [t.id for t in read_token_records(v1 / "heldout.jsonl")] == held
    for f in ("export/sglang/model.safetensors", "export/speculators/config.json",
              "eval-heldout.json"):
        assert (v1 / f).is_file(), f
    assert [p.name for p in v1.glob("eval-*.json")] == ["eval-heldout.json"]
    check_card((v1 / "export" / "sglang" / "README.md").read_text(), "llama")
    assert "dry run" in (r.stdout + r.stderr).lower()
    # everything is up to date: nothing reruns, not even training
    assert make("llama", "-q", "card", **variables).returncode == 0
    # a removed file is rebuilt from what exists; nothing upstream of it runs again
    (v1 / "export" / "sglang" / "README.md").unlink()
    r = ok(make("llama", "card", **variables))
    assert " push " in r.stdout and not {" train ", " eval ", " convert "} & set(
        f" {w} " for w in r.stdout.split())


def test_qwen3_v2_regenerates_in_non_thinking_mode(toy_data, e3k, tmp_path):
    target = tiny_target("qwen3", tmp_path / "target")
    out = tmp_path / "run"
    variables = toy("qwen3", target, out, toy_data, e3k, VERSION="v2", PROMPT_SETS="mt-bench")
    ok(make("qwen3", "all", **variables))
    original = {c.id: c for c in read_chat_records(out / "chats" / "train.jsonl")}
    regenerated = list(read_chat_records(out / "v2" / "regenerated" / "train.jsonl"))
    assert regenerated and {c.id for c in regenerated} <= set(original)
    assert any(c.messages != original[c.id].messages for c in regenerated)
    assert not list((out / "v2" / "regenerated").glob("*.part"))
    # non-thinking rendering: the empty think block is prompt, never loss
    tok = chat_tokenizers.qwen3()
    think = tok.convert_tokens_to_ids("<think>")
    records = list(read_token_records(out / "v2" / "train.jsonl"))
    assert all(think in r.input_ids for r in records)
    assert not any(m for r in records
                   for i, m in zip(r.input_ids, r.loss_mask, strict=True) if i == think)
    check_card((out / "v2" / "export" / "sglang" / "README.md").read_text(), "qwen3",
               ("mt-bench",))
    assert "toy/qwen3-eagle3" in (out / "v2" / "export" / "sglang" / "README.md").read_text()


# ---- full scale, printed only --------------------------------------------------------------

def commands(family: str, *args: str, **variables) -> list[list[str]]:
    r = ok(make(family, "-n", *args, **variables))
    return [shlex.split(line) for line in r.stdout.replace("\\\n", " ").splitlines()]


def eagle3kit(lines: list[list[str]]) -> dict[str, list[list[str]]]:
    """The eagle3kit commands by subcommand, each checked against the CLI's own options."""
    cli = typer.main.get_command(app)
    out: dict[str, list[list[str]]] = {}
    for words in lines:
        if "eagle3kit" not in words:
            continue
        i = words.index("eagle3kit")
        name, args = words[i + 1], words[i + 2:]
        known = {o for p in cli.commands[name].params for o in (*p.opts, *p.secondary_opts)}
        unknown = [a for a in args if a.startswith("-") and a != "-" and a not in known
                   and a != ">"]
        assert not unknown, f"eagle3kit {name}: {unknown}"
        out.setdefault(name, []).append(args)
    return out


def flags(args: list[str]) -> dict[str, str]:
    return {a: b for a, b in zip(args, [*args[1:], ""], strict=True) if a.startswith("--")}


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_make_n_prints_the_seeds_recipe(family, tmp_path):
    cmds = eagle3kit(commands(family, "all", "OUT=" + str(tmp_path / "r"),
                              "SHAREGPT=sharegpt.json"))
    assert list(cmds) == ["mix", "tokenize", "vocab-select", "train", "convert", "eval", "push"]
    (mix,) = cmds["mix"]
    assert mix[:3] == ["sharegpt.json:0.45", "hf:HuggingFaceH4/ultrachat_200k@train_sft:0.35",
                       "hf:mlabonne/open-perfectblend@train:0.2"]
    assert mix[mix.index("-n") + 1] == "54000"
    (train,) = cmds["train"]
    expected = {"--target": HUB_IDS[family], "--epochs": "3", "--lr": "3e-4",
                "--warmup-ratio": "0.03", "--ttt-length": "7", "--decay": "0.8",
                "--batch-size": "4", "--grad-accum": "2", "--seq-len": "2048",
                "--dtype": "bfloat16", "--mesh": "data=1,tensor=1"}
    assert {k: flags(train).get(k) for k in expected} == expected
    assert "--resume" not in train
    assert {a[a.index("--prompts") + 1] for a in cmds["eval"] if "--prompts" in a} == {
        "mt-bench", "humaneval"}
    assert len(cmds["tokenize"]) == 2 and all(
        ("--no-thinking" in a) == (family == "qwen3") for a in cmds["tokenize"])
    assert {a[a.index("--to") + 1] for a in cmds["convert"]} == {"sglang", "speculators"}
    assert all(flags(a)["--target-name"] == HUB_IDS[family] for a in cmds["convert"])


def test_presets_multi_host_and_resume(tmp_path):
    out = tmp_path / "r"
    common = ["OUT=" + str(out), "SHAREGPT=s.json"]
    (train,) = eagle3kit(commands("llama", "train", *common, "MESH_PRESET=EIGHT_GPU"))["train"]
    assert (flags(train)["--mesh"], flags(train)["--batch-size"],
            flags(train)["--grad-accum"]) == ("data=8,tensor=1", "8", "1")
    tpu = [*common, "MESH_PRESET=TPU_V4_32", "COORDINATOR=10.0.0.2:8476", "PROCESS_ID=2"]
    (train,) = eagle3kit(commands("qwen3", "train", *tpu))["train"]
    assert {k: flags(train)[k] for k in ("--mesh", "--coordinator", "--num-processes",
                                         "--process-id")} == {
        "--mesh": "data=4,tensor=4", "--coordinator": "10.0.0.2:8476", "--num-processes": "4",
        "--process-id": "2"}
    regen = eagle3kit(commands("qwen3", "regenerate-shard", *tpu, "VERSION=v2"))["regenerate"]
    assert sorted(flags(a)["--shard"] for a in regen) == ["2/4", "2/4"]
    assert all("--no-thinking" in a for a in regen)
    r = make("qwen3", "-n", "train", *common, "MESH_PRESET=TPU_V4_32")
    assert r.returncode != 0 and "set COORDINATOR" in r.stderr
    # an interrupted run (its config.json exists) continues instead of starting over
    (out / "v1" / "run").mkdir(parents=True)
    (out / "v1" / "run" / "config.json").write_text("{}")
    (train,) = eagle3kit(commands("llama", "train", *common))["train"]
    assert "--resume" in train


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_plain_make_uploads_nothing_and_finds_sharegpt(family, tmp_path):
    """`make` alone stops at the model card (its push is a --dry-run); `make push` refuses
    the placeholder organisation; SHAREGPT defaults to the file inside the installed
    package, as `make demo` finds it (issue 24, item 9)."""
    out = "OUT=" + str(tmp_path / "r")
    cmds = eagle3kit(commands(family, out, "SHAREGPT=s.json"))
    assert cmds["push"] and all("--dry-run" in a for a in cmds["push"]), cmds["push"]
    r = make(family, "-n", "push", out, "SHAREGPT=s.json")
    assert r.returncode != 0 and "is the placeholder: set HF_ORG" in r.stderr, r.stderr
    *card, push = eagle3kit(commands(family, "push", out, "SHAREGPT=s.json", "HF_ORG=me"))["push"]
    assert push[push.index("--repo-id") + 1].startswith("me/") and "--dry-run" not in push
    # the card names the recipe: the per-target Makefile and its VERSION
    recipe = f"examples/{RECIPES[family].parent.name}/Makefile VERSION=v1"
    assert [flags(a)["--recipe"] for a in (*card, push)] == [recipe] * (len(card) + 1)
    (mix,) = eagle3kit(commands(family, "data", out, f"PY={sys.executable}"))["mix"]
    assert mix[0] == f"{assets.sharegpt_path()}:0.45"
