"""Every numeric option of every command with 0, a negative and an absurd value (issue 39,
item 4): never a traceback; one `error:` line with the class's exit code (2: a value no run
can take, naming the option; 4: more than this machine has, naming it too), or the value is
taken and the command goes on until its never-loaded model (or a file that is no input of
its kind) stops it. All of it before any model is read."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from eagle3kit.cli.app import app

runner = CliRunner()
NEVER = "org/never-loaded"
ABSURD = "100000000"

# command: (arguments before the option, {option: outcomes at 0, -1 and ABSURD}); an outcome
# is 2 or 4 (refused, naming the option) or "ok" (taken). in.jsonl is one chat record.
COMMANDS = {
    "mix": (["mix", "in.jsonl", "-o", "o.jsonl"], {
        "-n": (2, 2, 2),  # more than the source holds: refused, naming -n
        "--seed": ("ok", 2, "ok")}),
    "tokenize": (["tokenize", "--tokenizer", NEVER, "-i", "in.jsonl", "-o", "o.jsonl"], {
        "--max-length": (2, 2, "ok"), "-j": (2, 2, 2)}),
    "vocab-select": (["vocab-select", "-i", "in.jsonl", "-o", "v.safetensors"], {
        "--size": (2, 2, "ok")}),
    "train": (["train", "--target", NEVER, "--data", "in.jsonl", "--vocab", "in.jsonl",
               "--out", "run"], {
        "--ttt-length": (2, 2, "ok"), "--decay": (2, 2, 2), "--epochs": (2, 2, "ok"),
        "--max-steps": (2, 2, "ok"), "--lr": (2, 2, "ok"), "--warmup-ratio": ("ok", 2, 2),
        "--min-lr-ratio": ("ok", 2, 2), "--weight-decay": ("ok", 2, "ok"),
        "--clip-norm": (2, 2, "ok"), "--batch-size": (2, 2, 4), "--seq-len": (2, 2, "ok"),
        "--grad-accum": (2, 2, 4), "--time-limit": (2, 2, "ok"), "--save-every": (2, 2, "ok"),
        "--keep-checkpoints": (2, 2, "ok"), "--eval-every": (2, 2, "ok"),
        "--log-every": (2, 2, "ok"), "--seed": ("ok", 2, "ok"),
        "--num-processes": (2, 2, 2), "--process-id": ("ok", 2, 2)}),
    "eval": (["eval", "--target", NEVER, "--draft", "d", "--prompts", "mt-bench"], {
        "--steps": (2, 2, 2), "--topk": (2, 2, 2), "--draft-tokens": (2, 2, 2),
        "--max-new-tokens": (2, 2, "ok"), "--temperature": ("ok", 2, "ok"),
        "--limit": (2, 2, "ok"), "--seed": ("ok", 2, "ok")}),
    "eval --data": (["eval", "--target", NEVER, "--draft", "d", "--data", "in.jsonl"], {
        "--batch-size": (2, 2, 4), "--seq-len": (2, 2, "ok")}),
    "regenerate": (["regenerate", "--target", NEVER, "-i", "in.jsonl", "-o", "o.jsonl"], {
        "--temperature": ("ok", 2, "ok"), "--top-p": (2, 2, 2), "--top-k": ("ok", 2, "ok"),
        "--samples": (2, 2, 2), "--seed": ("ok", 2, "ok"), "--max-new-tokens": (2, 2, "ok"),
        "--max-context": (2, 2, "ok"), "--repeat-copies": ("ok", 2, "ok"),
        "--repeat-min-tokens": (2, 2, "ok"), "--repeat-max-block": (2, 2, "ok"),
        "--limit": (2, 2, "ok"), "--slots": (2, 2, "ok"), "--sync-every": (2, 2, "ok"),
        "--mixed-budget": ("ok", 2, "ok"), "--concurrency": (2, 2, "ok"), "--timeout": (2, 2, 2), "--retries": ("ok", 2, "ok")}),
    "convert": (["convert", "d", "--to", "sglang", "-o", "out"], {
        "--speculative-tokens": (2, 2, 2)}),
}
# what the message may call an option (Typer names -j by its long form)
ALIASES = {"-j": ("-j", "--jobs")}
# the refusals of a taken value, each before any model is read: the model, the draft, or a
# chat record given where a vocab file or token records are read
LATER = (f"error: {NEVER}: no such directory", "error: d: no such draft",
         "error: in.jsonl: not a safetensors file", "error: in.jsonl:1: not a token record")


@pytest.mark.parametrize("command", list(COMMANDS))
def test_numeric_options_at_zero_negative_and_absurd(command, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "in.jsonl").write_text('{"id": "a", "messages": [{"role": "user", "content": '
                                       '"hi"}, {"role": "assistant", "content": "yo"}]}\n')
    args, options = COMMANDS[command]
    for option, outcomes in options.items():
        for value, expected in zip(("0", "-1", ABSURD), outcomes, strict=True):
            case = (command, option, value)
            r = runner.invoke(app, [*args, option, value])
            assert r.exception is None or isinstance(r.exception, SystemExit), (
                case, repr(r.exception))
            lines = r.output.strip().splitlines()
            if expected == "ok" and r.exit_code == 0:  # mix has no model to stop it
                assert command == "mix", (case, r.output)
                (tmp_path / "o.jsonl").unlink()
                continue
            if expected == "ok":
                assert r.exit_code == 2 and len(lines) == 1, (case, r.output)
                assert lines[0].startswith(LATER), (case, r.output)
            else:
                assert r.exit_code == expected, (case, r.output)
                assert len(lines) == 1 and lines[0].startswith("error: "), (case, r.output)
                assert any(name in lines[0] for name in ALIASES.get(option, (option,))), (
                    case, r.output)
            assert sorted(p.name for p in tmp_path.iterdir()) == ["in.jsonl"], case
