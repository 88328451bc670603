"""A P-EAGLE draft (core/peagle.py) in eagle3kit's own format and refused by the engine
format that cannot hold it."""

from __future__ import annotations

import json

import numpy as np
from typer.testing import CliRunner

from eagle3kit.cli.app import app
from eagle3kit.core.draft import arrays
from eagle3kit.io.draft_io import load_draft, save_draft
from tests.formats.helpers import peagle_draft


def test_peagle_round_trips_natively_and_sglang_refuses_it(target, tmp_path):
    d = peagle_draft(target, num_layers=2, fc_norm=True)
    final = save_draft(tmp_path / "final", d)
    written = json.loads((final / "draft_config.json").read_text())["draft"]
    assert (written["method"], written["num_layers"], written["block_size"],
            written["mask_token_id"]) == ("peagle", 2, 4, 7)
    back = load_draft(final)
    assert back.config == d.config and back.config.arch == "peagle+fc_norm"  # an unregistered mix
    for field, value in arrays(d.weights).items():
        np.testing.assert_array_equal(getattr(back.weights, field), value, err_msg=field)
    r = CliRunner().invoke(app, ["convert", str(final), "--to", "sglang", "-o",
                                 str(tmp_path / "sg")], env={"COLUMNS": "250"})
    assert r.exit_code == 3, r.output
    assert r.output.strip().splitlines()[-1] == (
        "error: the peagle+fc_norm draft cannot be written in the SGLang format; choose "
        "speculators or eagle3kit")
    assert not (tmp_path / "sg").exists()


def test_a_published_checkpoint_of_an_unknown_method_is_refused(target, tmp_path):
    d = peagle_draft(target, num_layers=1, fc_norm=False)
    r = CliRunner().invoke(app, ["convert", str(save_draft(tmp_path / "final", d)), "--to",
                                 "speculators", "-o", str(tmp_path / "v")])
    assert r.exit_code == 0, r.output
    config = tmp_path / "v" / "config.json"
    config.write_text(config.read_text().replace('"speculators_model_type": "peagle"',
                                                 '"speculators_model_type": "dspark"'))
    r = CliRunner().invoke(app, ["convert", str(tmp_path / "v"), "--to", "eagle3kit", "-o",
                                 str(tmp_path / "back")], env={"COLUMNS": "250"})
    assert r.exit_code == 2 and r.output.strip().splitlines()[-1] == (
        f"error: {config}: speculators_model_type 'dspark' is not a draft method eagle3kit "
        "reads (eagle3, peagle, dflash)"), r.output
    assert not (tmp_path / "back").exists()
