"""`eagle3kit push` through the CLI: --dry-run touches no network, a real push goes through
huggingface_hub to a local recording Hub in one commit, eval results come from files or
stdin, and a missing token fails before anything is written."""

from __future__ import annotations

import json

import huggingface_hub.constants
import pytest
from huggingface_hub import ModelCard
from typer.testing import CliRunner

import eagle3kit
from eagle3kit.cli.app import app
from eagle3kit.formats import export_draft
from eagle3kit.io.draft_io import save_draft
from tests.formats.helpers import make_draft, tiny_target
from tests.hub.hub_server import hub_server

runner = CliRunner()
TOKEN = "hf_cli_test_token_5f3a"
EVAL = {"mode": "teacher-forced", "dataset": "mt-bench", "acc": [0.61, 0.58, 0.57],
        "cond_acc": [0.61, 0.7, 0.72], "tau": 2.31}


def push(*args, input=None, env=None):
    return runner.invoke(app, ["push", *map(str, args)], input=input,
                         env={"COLUMNS": "250", **(env or {})})


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return tiny_target(tmp_path_factory.mktemp("target"))


@pytest.fixture()
def export(target, tmp_path):
    d = make_draft(target, name="meta-llama/Llama-3.1-8B-Instruct",
                   training={"epochs": 3, "ttt_length": 7})
    return export_draft(d, "sglang", tmp_path / "sglang")


@pytest.fixture()
def hub(monkeypatch):
    with hub_server() as server:
        monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
        yield server


def test_dry_run_writes_the_card_and_touches_no_network(export, hub, tmp_path):
    (tmp_path / "eval.json").write_text(json.dumps(EVAL))
    r = push(export, "--repo-id", "my-org/Llama-3.1-8B-Instruct-Eagle3", "--eval",
             tmp_path / "eval.json", "--dry-run",
             env={"HF_ENDPOINT": hub.url, "HF_TOKEN": ""})
    assert r.exit_code == 0, r.output
    assert hub.requests == [] and r.stdout == ""
    assert "dry run: would upload 4 files" in r.output and "public repo" in r.output
    for name in ("README.md", "config.json", "eagle3kit.json", "model.safetensors"):
        assert name in r.output
    card = ModelCard((export / "README.md").read_text())
    assert card.data.base_model == "meta-llama/Llama-3.1-8B-Instruct"
    assert card.data.license == "llama3.1"  # the target's license, known by its Hub id
    assert "| mt-bench (teacher-forced) | 2.31 | 61.0% | 58.0% | 57.0% | - |" in card.text
    assert "| TTT length | 7 steps (training-time test) |" in card.text


def test_push_is_one_commit_through_the_real_client(export, hub):
    r = push(export, "--repo-id", "my-org/x-Eagle3", "--private", "--revision", "v1",
             "--commit-message", "release v1", "--eval", "-", input=json.dumps(EVAL),
             env={"HF_ENDPOINT": hub.url, "HF_TOKEN": TOKEN})
    assert r.exit_code == 0, r.output
    assert r.stdout.strip() == f"{hub.url}/my-org/x-Eagle3/commit/c0ffee"
    assert TOKEN not in r.output
    create = next(r for r in hub.requests if r.path == "/api/repos/create")
    assert create.json()["visibility"] == "private"
    assert any(q.path == "/api/models/my-org/x-Eagle3/branch/v1" for q in hub.requests)
    files = hub.committed_files()
    assert set(files) == {"README.md", "config.json", "eagle3kit.json", "model.safetensors"}
    assert files["model.safetensors"] == (export / "model.safetensors").read_bytes()
    assert b"mt-bench (teacher-forced)" in files["README.md"]  # the eval came from stdin
    commit = next(q for q in hub.requests if "/commit/" in q.path)
    assert commit.ndjson()[0]["value"]["summary"] == "release v1"


def test_no_token_fails_before_writing(export, tmp_path, monkeypatch):
    # no stored login (the path is read once, at import)
    monkeypatch.setattr(huggingface_hub.constants, "HF_TOKEN_PATH", str(tmp_path / "token"))
    r = push(export, "--repo-id", "my-org/x", env={"HF_TOKEN": "", "HUGGING_FACE_HUB_TOKEN": ""})
    assert r.exit_code == 6 and "no Hugging Face token: set HF_TOKEN" in r.output
    assert not (export / "README.md").exists()


def test_hub_refusal_is_one_line(export, hub):
    hub.fail_with["/commit/"] = 401
    r = push(export, "--repo-id", "my-org/x", env={"HF_ENDPOINT": hub.url, "HF_TOKEN": TOKEN})
    assert r.exit_code == 6 and "push to my-org/x failed (commit)" in r.output
    assert "401" in r.output and TOKEN not in r.output and "Traceback" not in r.output


def test_results_of_another_draft_are_refused(target, tmp_path):
    """`push --eval` of results that measured another draft (another run, another vocab)
    is refused naming both (issue 39, item 7); results of the exported draft, measured on its
    training output (fp32) or on the export itself (bf16), are taken. An eval result from
    before digests were recorded gets a warning."""
    from eagle3kit.formats import common, load_any_draft

    ours = make_draft(target, name="meta-llama/Llama-3.1-8B-Instruct", seed=0)
    other = make_draft(target, name="meta-llama/Llama-3.1-8B-Instruct", seed=1)
    export = export_draft(ours, "sglang", tmp_path / "sglang", source="runs/sig/final")
    as_loaded = load_any_draft(str(export))  # what `eval --draft export` measures
    results = {
        "other": {**EVAL, "draft": "runs/a/final", "draft_digest": common.draft_digest(other)},
        "source": {**EVAL, "draft": "runs/sig/final", "draft_digest": common.draft_digest(ours)},
        "export": {**EVAL, "draft": str(export),
                   "draft_digest": common.draft_digest(as_loaded)},
        "old": EVAL}
    for name, result in results.items():
        (tmp_path / f"{name}.json").write_text(json.dumps(result))
    r = push(export, "--repo-id", "my-org/x", "--eval", tmp_path / "other.json", "--dry-run")
    assert r.exit_code == 3, r.output
    assert r.output.startswith(f"error: {tmp_path / 'other.json'}: measured another draft "
                               "(runs/a/final, digest "), r.output
    assert "than the one exported here (from runs/sig/final" in r.output
    assert len(r.output.splitlines()) == 1 and not (export / "README.md").exists()
    r = push(export, "--repo-id", "my-org/x", "--eval", tmp_path / "source.json", "--eval",
             tmp_path / "export.json", "--dry-run")
    assert r.exit_code == 0 and "warning" not in r.output, r.output
    r = push(export, "--repo-id", "my-org/x", "--eval", tmp_path / "old.json", "--dry-run")
    assert r.exit_code == 0, r.output
    assert "warning: " + str(tmp_path / "old.json") + ": cannot check that it measured this " \
        "export's draft" in r.output, r.output


def test_an_unconverted_draft_gets_a_command_that_works(target, tmp_path, monkeypatch):
    """push of an eagle3kit-format draft suggests `convert ... -o PATH` with a PATH that does
    not exist yet (it suggested export/sglang, already there; issue 39, item 10)."""
    monkeypatch.chdir(tmp_path)
    save_draft(tmp_path / "final", make_draft(target))
    (tmp_path / "export" / "sglang").mkdir(parents=True)
    (tmp_path / "final-sglang").mkdir()
    r = push("final", "--repo-id", "my-org/x", "--dry-run")
    assert r.exit_code == 2, r.output
    assert r.output.strip().endswith("convert it first: eagle3kit convert final --to sglang "
                                     "-o final-sglang-2"), r.output
    assert r.output.count("\n") == 1 and not (tmp_path / "final-sglang-2").exists()


def test_bad_input(export, target, tmp_path):
    save_draft(tmp_path / "final", make_draft(target))
    (tmp_path / "bad.json").write_text('{"acc": "high"}')
    cases = [
        ((tmp_path / "final", "--repo-id", "my-org/x"), "convert it first"),
        ((export, "--repo-id", "not-a-repo"), "is not ORG/NAME"),
        ((export, "--repo-id", "my-org/x", "--eval", tmp_path / "bad.json"),
         "bad.json: not an eval result"),
        ((tmp_path / "nowhere", "--repo-id", "my-org/x"), "no such directory"),
    ]
    # the cases: any JSON, and a train run's metrics.jsonl, are not eval results
    (tmp_path / "foo.json").write_text('{"foo": 1}')
    (tmp_path / "metrics.jsonl").write_text(
        '{"step": 1, "epoch": 0, "loss": 9.1, "acc": [0.1], "tau": 1.1}\n'
        '{"step": 2, "eval": true, "acc": [0.2], "cond_acc": [0.2], "tau": 1.2}\n')
    cases += [((export, "--repo-id", "my-org/x", "--eval", tmp_path / "foo.json"),
               "foo.json: not an eval result from `eagle3kit eval --json` (no mode, acc, tau)"),
              ((export, "--repo-id", "my-org/x", "--eval", tmp_path / "metrics.jsonl"),
               "metrics.jsonl:1: not an eval result from `eagle3kit eval --json` (no mode)")]
    for args, message in cases:
        r = push(*args, "--dry-run")
        assert r.exit_code == 2 and message in r.output, (args, r.output)
    assert not (export / "README.md").exists()


def test_a_users_own_card_is_kept(export):
    (export / "README.md").write_text("# my card\n")
    r = push(export, "--repo-id", "my-org/x", "--dry-run")
    assert r.exit_code == 0 and "keeping" in r.output
    assert (export / "README.md").read_text() == "# my card\n"


def test_help_has_a_runnable_example():
    r = runner.invoke(app, ["push", "--help"], env={"COLUMNS": "250"})
    assert r.exit_code == 0 and "Example:" in r.output and "--dry-run" in r.output


GENERATE = {"mode": "generate", "dataset": "humaneval", "acc": [0.84, 0.8], "tau": 4.4,
            "tau_generate": 3.97, "speedup": 2.9, "device": "NVIDIA H200", "steps": 7,
            "topk": 1, "draft_tokens": 8, "temperature": 0.0}


def test_evals_of_one_data_set_at_two_shapes_read_apart(export, tmp_path):
    """A chain and a tree on the same prompts: each row and heading names its shape (the
    eval's steps/topk/draft_tokens); a teacher-forced row names its data as before."""
    shapes = {"k7": {}, "tree": {"steps": 5, "topk": 4, "draft_tokens": 8, "speedup": 2.85}}
    for name, extra in shapes.items():
        (tmp_path / f"{name}.json").write_text(json.dumps(GENERATE | extra))
    (tmp_path / "tf.json").write_text(json.dumps(EVAL))
    r = push(export, "--repo-id", "my-org/x", "--dry-run", *(
        a for f in ("k7", "tree", "tf") for a in ("--eval", tmp_path / f"{f}.json")))
    assert r.exit_code == 0, r.output
    text = (export / "README.md").read_text()
    chain, tree = "humaneval, chain K=7", "humaneval, tree 5/4/8 (depth 5, top-4, 8 tokens)"
    assert f"| {chain} | 3.97 | 84.0% | 80.0% | - | 2.90x |" in text
    assert f"| {tree} | 3.97 | 84.0% | 80.0% | - | 2.85x |" in text
    assert f"\n### {chain}\n" in text and f"\n### {tree}\n" in text
    assert "| mt-bench (teacher-forced) | 2.31 |" in text and "(generate)" not in text


# what every `train` run records, whatever its --arch (jobs/config.TrainConfig)
PARALLEL_OPTIONS = {"anchors": 0, "block_size": 8, "draft_layers": 1, "mask_token_id": 5}


def test_a_methods_own_options_show_only_for_that_method(target, tmp_path):
    """An EAGLE-3.1 run records DFlash's --block-size, --draft-layers, --anchors too; its
    card shows none of them, a DFlash draft's card shows all (core/arches.py `options`)."""
    from tests.formats.test_dflash_formats import make_dflash

    training = {"epochs": 3, "ttt_length": 7, "seed": 0, **PARALLEL_OPTIONS}
    d31 = make_draft(target, arch="eagle3.1", training={**training, "arch": "eagle3.1"})
    dfl = make_dflash(target)
    dfl.training = {**training, "arch": "dflash"}
    for d, fmt, shown in ((d31, "sglang", False), (dfl, "speculators", True)):
        export = export_draft(d, fmt, tmp_path / d.config.arch)
        r = push(export, "--repo-id", "my-org/x", "--dry-run")
        assert r.exit_code == 0, r.output
        text = (export / "README.md").read_text()
        assert f"| arch | {d.config.arch} |" in text and "| seed | 0 |" in text
        for key, value in PARALLEL_OPTIONS.items():
            assert (f"| {key} | {value} |" in text) is shown, (d.config.arch, key)


def test_the_card_names_the_recipe_it_is_given(export):
    """--recipe is the Training details' row after Framework (issue 35); without it the
    card has no such row."""
    recipe = "examples/qwen2.5-coder-1.5b/Makefile VERSION=v2"
    for given, row in ((["--recipe", recipe], f"| Recipe | {recipe} |\n"), ([], "")):
        r = push(export, "--repo-id", "my-org/x", "--dry-run", *given)
        assert r.exit_code == 0, r.output
        text = (export / "README.md").read_text()
        assert f"| Framework | eagle3kit {eagle3kit.__version__}, pure JAX |\n{row}| Epochs |" \
            in text
        assert ("| Recipe |" in text) is bool(given)
