"""Engine configs of a draft for a GGUF target: the header stores rms_norm_eps (and the rope
base) as float32, so the target config says 9.999999747378752e-06 where SmolLM2's own
config.json says 1e-05 (tests/core/test_gemma3_real.py holds that reading equal to
transformers'). What an export writes for a serving engine reads as the model's own config:
the float32's shortest decimal, the same float32."""

from __future__ import annotations

import json

import numpy as np
import pytest

from eagle3kit.formats import export_draft, load_any_draft
from eagle3kit.formats.common import float32_shortest
from eagle3kit.io.hf import resolve_target
from tests import assets
from tests.formats.helpers import Target, make_draft
from tests.formats.test_dflash_formats import make_dflash


def test_float32_values_get_their_shortest_decimal():
    born = float(np.float32(1e-6))
    assert born == 9.999999974752427e-07
    got = float32_shortest({"eps": born, "theta": float(np.float32(1e6)), "x": [born, 0.5],
                            "f64": 0.123456789012, "n": 3, "flag": True, "name": "a", "nan": float("nan")})
    assert got["eps"] == 1e-06 and got["x"] == [1e-06, 0.5] and got["theta"] == 1e6
    assert got["f64"] == 0.123456789012  # not a float32 value: a float64 the user wrote, kept
    assert got["n"] == 3 and got["flag"] is True and got["name"] == "a"
    assert np.isnan(got["nan"])
    assert np.float32(got["eps"]) == np.float32(born)  # the engine's float32 is unchanged


@pytest.mark.parametrize("fmt", ["sglang", "speculators"])
@pytest.mark.parametrize("arch", ["eagle3.1", "dflash"])
def test_gguf_born_fields_read_as_the_models_config(tmp_path, fmt, arch):
    gguf = assets.smollm2_gguf()
    ckpt = resolve_target(gguf)
    eps = ckpt.config.rms_norm_eps
    assert eps == 9.999999747378752e-06  # the header's float32 of 1e-05
    t = Target(gguf, None, ckpt)
    d = make_dflash(t, layers=1) if arch == "dflash" else make_draft(t, arch=arch)
    out = export_draft(d, fmt, tmp_path / fmt, target_name="HuggingFaceTB/SmolLM2-135M-Instruct")
    text = (out / "config.json").read_text()
    assert repr(eps) not in text and '"rms_norm_eps": 1e-05' in text
    raw = json.loads(text)
    fields = raw.get("transformer_layer_config", raw)
    assert fields["rms_norm_eps"] == 1e-05 and fields["rope_theta"] == 100000.0
    # the import computes with the same float32 the draft was trained with
    back = load_any_draft(out)
    assert np.float32(back.config.rms_norm_eps) == np.float32(eps)
