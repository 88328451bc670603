"""`eagle3kit convert` through the CLI: a training output to each engine format and back,
a published midlayer draft imported with its target, and every refusal as one clear line."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import numpy as np
import pytest
from typer.testing import CliRunner

from eagle3kit.cli.app import app
from eagle3kit.core.draft import arrays as draft_arrays
from eagle3kit.formats import export_draft, load_any_draft
from eagle3kit.io.draft_io import load_draft, save_draft
from tests.formats.helpers import make_draft, tiny_target

runner = CliRunner()


def convert(*args):
    return runner.invoke(app, ["convert", *map(str, args)], env={"COLUMNS": "250"})


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return tiny_target(tmp_path_factory.mktemp("target"))


@pytest.fixture(scope="module")
def run_final(target, tmp_path_factory):
    """What `eagle3kit train` leaves in OUT/final (the target recorded by its path)."""
    d = make_draft(target, name=str(target.directory), training={"epochs": 2, "lr": 1e-4})
    return save_draft(tmp_path_factory.mktemp("run") / "final", d)


def test_training_output_to_both_engines_and_back(run_final, tmp_path):
    r = convert(run_final, "--to", "sglang", "-o", tmp_path / "sg", "--dtype", "float32",
                "--target-name", "org/tiny-llama")
    assert r.exit_code == 0, r.output
    assert "wrote" in r.output and "sglang format, float32" in r.output and r.stdout == ""
    r = convert(run_final, "--to", "speculators", "-o", tmp_path / "v", "--target-name",
                "org/tiny-llama", "--speculative-tokens", "4")
    assert r.exit_code == 0, r.output
    cfg = json.loads((tmp_path / "v" / "config.json").read_text())
    assert cfg["speculators_config"]["verifier"]["name_or_path"] == "org/tiny-llama"
    assert cfg["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 4
    r = convert(tmp_path / "sg", "--to", "eagle3kit", "-o", tmp_path / "back")
    assert r.exit_code == 0, r.output
    original, back = load_draft(run_final), load_draft(tmp_path / "back")
    assert back.config == original.config and back.training == original.training
    assert back.target_name == "org/tiny-llama"
    for f in draft_arrays(original.weights):
        assert np.array_equal(getattr(back.weights, f), getattr(original.weights, f)), f


@pytest.mark.parametrize("arch,engine", [("eagle3.1", "speculators"), ("eagle3.1", "sglang"),
                                         ("eagle3.1-fc", "sglang"), ("eagle3.1-fc", "speculators")])
def test_eagle31_drafts_to_the_engines_that_express_them_and_back(target, tmp_path, arch,
                                                                  engine):
    d = make_draft(target, name=str(target.directory), arch=arch, seed=4)
    src = save_draft(tmp_path / "final", d)
    r = convert(src, "--to", engine, "-o", tmp_path / "e", "--target-name", "org/tiny-llama",
                "--dtype", "float32")
    assert r.exit_code == 0, r.output
    written = json.loads((tmp_path / "e" / "config.json").read_text())
    assert written["fc_norm"] is True
    if engine == "speculators":  # speculators/vLLM: the 3.1 flags, always written
        assert written["norm_output"] is d.config.norm_output
    else:  # SGLang: only when true (SpecForge 0.2.0 read false as "no norm before lm_head")
        assert written.get("norm_output", False) is d.config.norm_output
        assert ("norm_output" in written) is d.config.norm_output
    r = convert(tmp_path / "e", "--to", "eagle3kit", "-o", tmp_path / "back")
    assert r.exit_code == 0, r.output
    back = load_draft(tmp_path / "back")
    assert back.config == d.config and back.config.arch == arch
    for f in draft_arrays(d.weights):
        assert np.array_equal(getattr(back.weights, f), getattr(d.weights, f)), f


def test_published_midlayer_draft_needs_its_target(target, run_final, tmp_path):
    out = export_draft(load_draft(run_final), "sglang", tmp_path / "published")
    (out / "eagle3kit.json").unlink()  # as other tools publish it
    r = convert(out, "--to", "eagle3kit", "-o", tmp_path / "imported")
    assert r.exit_code == 3 and "cannot determine the draft's target" in r.output
    assert "--target MODEL" in r.output and not (tmp_path / "imported").exists()
    r = convert(out, "--to", "eagle3kit", "-o", tmp_path / "imported", "--target",
                target.directory)
    assert r.exit_code == 0, r.output
    assert load_any_draft(tmp_path / "imported").config.aux_layer_ids == (2, 4, 5)


def test_existing_output_needs_force(run_final, tmp_path):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "mine.txt").write_text("keep")
    r = convert(run_final, "--to", "sglang", "-o", tmp_path / "out")
    assert r.exit_code == 2 and "already exists (pass --force to replace it)" in r.output
    assert (tmp_path / "out" / "mine.txt").read_text() == "keep"
    r = convert(run_final, "--to", "sglang", "-o", tmp_path / "out", "--force")
    assert r.exit_code == 2 and "did not write (mine.txt)" in r.output, r.output
    assert (tmp_path / "out" / "mine.txt").read_text() == "keep"


def test_force_over_an_export_leaves_nothing_behind(run_final, tmp_path):
    assert convert(run_final, "--to", "sglang", "-o", tmp_path / "out").exit_code == 0
    r = convert(run_final, "--to", "sglang", "-o", tmp_path / "out", "--force")
    assert r.exit_code == 0, r.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no .out.old
    assert (tmp_path / "out" / "config.json").is_file()
    (tmp_path / "file").write_text("a file, not a directory")
    r = convert(run_final, "--to", "sglang", "-o", tmp_path / "file", "--force")
    assert r.exit_code == 2 and "is a file" in r.output, r.output
    assert (tmp_path / "file").read_text() == "a file, not a directory"


def test_dash_is_not_a_directory_name(run_final, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    r = convert(run_final, "--to", "sglang", "-o", "-")
    assert r.exit_code == 2 and "-o -: an export (a directory of files) cannot go to stdout" \
        in r.output, r.output
    assert list(tmp_path.iterdir()) == []


def test_bad_input_is_one_line_and_writes_nothing(target, run_final, tmp_path):
    save_draft(tmp_path / "nameless", make_draft(target, name=""))
    (tmp_path / "weird").mkdir()
    (tmp_path / "weird" / "config.json").write_text(json.dumps({"architectures": ["Bert"]}))
    cases = [
        ((tmp_path / "weird", "--to", "sglang"), 2, "unknown draft format"),
        ((tmp_path / "missing", "--to", "sglang"), 2, "no such draft"),
        ((run_final, "--to", "gguf"), 2, "'gguf'; choose one of sglang, speculators"),
        ((run_final, "--to", "sglang", "--dtype", "int4"), 2, "--dtype 'int4': choose bfloat16, float16, float32"),
        ((tmp_path / "nameless", "--to", "speculators"), 3, "pass --target-name ORG/MODEL"),
    ]
    for args, code, message in cases:
        r = convert(*args, "-o", tmp_path / "out")
        assert r.exit_code == code, (args, r.output)
        assert message in r.output, (args, r.output)
        assert "Traceback" not in r.output
        assert not (tmp_path / "out").exists(), args


def test_a_training_run_points_at_its_draft(target, run_final, tmp_path):
    """`convert runs/a` (the run, not its draft) names runs/a/final (issue 39, item 10)."""
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "config.json").write_text(json.dumps({"config": {}, "fingerprints": {}}))
    r = convert(run, "--to", "sglang", "-o", tmp_path / "out")
    assert r.exit_code == 2 and r.output == (f"error: {run}: is a training run with no final "
                                             "draft yet (it stopped at a checkpoint: finish "
                                             "it with train --resume)\n"), r.output
    save_draft(run / "final", make_draft(target))
    r = convert(run, "--to", "sglang", "-o", tmp_path / "out")
    assert r.exit_code == 2 and r.output == (f"error: {run}: is a training run, not a draft; "
                                             f"its draft is {run / 'final'}\n"), r.output
    assert not (tmp_path / "out").exists()


def test_wrong_layers_for_the_target_are_refused(target, tmp_path):
    d = make_draft(target, aux_layer_ids=(0, 2, 4))
    save_draft(tmp_path / "final", d)
    r = convert(tmp_path / "final", "--to", "sglang", "-o", tmp_path / "sg")
    assert r.exit_code == 3 and "[0] outside 1..7" in r.output
    assert not (tmp_path / "sg").exists()


def test_help_has_a_runnable_example():
    r = runner.invoke(app, ["convert", "--help"], env={"COLUMNS": "250"})
    assert r.exit_code == 0 and "Example:" in r.output
    assert "eagle3kit convert runs/smollm2/final --to sglang -o export/sglang" in r.output


def test_real_process_exit_code(run_final, tmp_path):
    """The installed entry point, in its own process: stderr for humans, stdout empty."""
    p = subprocess.run([sys.executable, "-m", "eagle3kit", "convert", str(run_final), "--to",
                        "speculators", "-o", str(tmp_path / "v")],
                       capture_output=True, text=True, timeout=120)
    # the training output recorded a local target path: warned about, still written
    assert p.returncode == 0, p.stderr
    assert p.stdout == "" and "not a Hub id" in p.stderr


def test_force_replaces_only_an_earlier_export(run_final, tmp_path):
    """`--force` never deletes a training output or a user's files: an output that is, holds
    or lies inside the source, or an existing directory that is not (only) an export of ours,
    is refused before anything is read or written (issue 24, item 1)."""
    run = tmp_path / "run"
    shutil.copytree(run_final, run / "final")
    (run / "config.json").write_text("{}")
    (run / "checkpoints").mkdir()
    precious = tmp_path / "precious"
    precious.mkdir()
    (precious / "notes.txt").write_text("x")
    export = tmp_path / "export"
    assert convert(run_final, "--to", "sglang", "-o", export).exit_code == 0
    (export / "README.md").write_text("my own card\n")
    before = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    cases = [
        (run / "final", run / "final", "is the source draft"),
        (run / "final", run, "holds the source draft"),
        (run / "final", run / "final" / "sub", "lies inside the source draft"),
        (run_final, precious, "holds files eagle3kit did not write (notes.txt)"),
        (run_final, export, "holds files eagle3kit did not write (README.md)"),
        (run_final, run / "final", "is the draft of the training run"),
    ]
    for source, out, message in cases:
        r = convert(source, "--to", "sglang", "-o", out, "--force")
        assert r.exit_code == 2 and message in r.output, (out, r.output)
        assert len(r.output.strip().splitlines()) == 1, r.output
    assert {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()} == before
    (export / "README.md").unlink()  # now only what convert wrote: replaced
    r = convert(run_final, "--to", "speculators", "-o", export, "--force")
    assert r.exit_code == 0, r.output
    assert json.loads((export / "eagle3kit.json").read_text())["engine_format"] == "speculators"
