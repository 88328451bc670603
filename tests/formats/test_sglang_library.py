"""SGLang 0.5.23's own `LlamaForCausalLMEagle3` (sglang/srt/models/llama_eagle3.py) loads
eagle3kit's SGLang exports, EAGLE3 and both EAGLE-3.1 variants, with every tensor landing in
a parameter and every parameter but the target-owned embedding written, and its draft forward
gives eagle3kit's logits at fp32 over two steps (the second reads the state the first carried:
pre-norm, or post-norm with `norm_output`). `make test` installs sglang without its
dependencies; SGLang runs in a process of its own (tests/formats/sglang_runner.py says what is
shimmed), once for every case. Skipped where sglang is not installed.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from eagle3kit.formats import export_draft
from tests.formats.helpers import assert_same_logits, jax_logits, make_draft

pytestmark = [pytest.mark.slow, pytest.mark.skipif(
    importlib.util.find_spec("sglang") is None, reason="sglang is not installed")]

RUNNER = Path(__file__).with_name("sglang_runner.py")
CASES = {"eagle3": {}, "eagle3-custom-layers": {"aux_layer_ids": (5, 1, 3)},
         "eagle3.1": {"arch": "eagle3.1"}, "eagle3.1-fc": {"arch": "eagle3.1-fc"}}
STEPS = 2


def _sglang_captures(config: dict, n_layers: int) -> list[int]:
    """HF hidden_states indices SGLang captures: eagle_config ids are "output of layer"."""
    ids = (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    return sorted(i + 1 for i in ids) if ids else [2, n_layers // 2, n_layers - 3]


@pytest.fixture(scope="module")
def sglang_run(target, tokens, tmp_path_factory):
    """{case: (draft, export dir, SGLang's logits, SGLang's load report)}, one process."""
    root = tmp_path_factory.mktemp("sglang")
    with torch.no_grad():
        states = target.model(torch.tensor(tokens), output_hidden_states=True).hidden_states
        embeds = target.model.get_input_embeddings()(torch.tensor(tokens)).numpy()
    drafts, request = {}, []
    for i, (name, kw) in enumerate(CASES.items()):
        d = make_draft(target, seed=11 + i, **kw)
        out = export_draft(d, "sglang", root / name, dtype="float32")
        config = json.loads((out / "config.json").read_text())
        aux = torch.cat([states[c] for c in _sglang_captures(config, target.num_layers)], -1)
        np.savez(root / f"{name}-in.npz", embeds=embeds, aux=aux.numpy(), steps=STEPS)
        request.append({"export": str(out), "inputs": str(root / f"{name}-in.npz"),
                        "outputs": str(root / f"{name}-out.npz")})
        drafts[name] = (d, out)
    (root / "request.json").write_text(json.dumps(request))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    r = subprocess.run([sys.executable, str(RUNNER), str(root / "request.json")], env=env,
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-4000:]
    return {name: (d, out, np.load(root / f"{name}-out.npz")["logits"],
                   json.loads((root / f"{name}-out.json").read_text()))
            for name, (d, out) in drafts.items()}


@pytest.mark.parametrize("case", list(CASES))
def test_sglang_loads_every_tensor_of_the_export(sglang_run, case):
    from safetensors import safe_open

    d, out, _, report = sglang_run[case]
    assert report["fc_norm"] is d.config.fc_norm
    assert report["norm_output"] is d.config.norm_output
    assert report["num_aux_hidden_states"] == 3
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert set(report["landed"]) == names
    # t2d is SGLang's to skip (it maps with d2t alone); every other tensor lands somewhere
    skipped = sorted(n for n, params in report["landed"].items() if not params)
    assert skipped == ["d2t", "t2d"]
    assert report["hot_token_id"] == d.vocab.used_ids.tolist()
    if d.config.fc_norm:
        assert {report["landed"][f"fc_norm.{i}.weight"][0] for i in range(3)} == {
            f"model.fc_norm.{i}.weight" for i in range(3)}
    # SGLang embeds with the target's embedding: the one parameter an export never writes
    assert report["unwritten"] == ["model.embed_tokens.weight"]


@pytest.mark.parametrize("case", list(CASES))
def test_sglang_model_gives_eagle3kit_logits(sglang_run, target, tokens, case):
    d, _, logits, _ = sglang_run[case]
    assert_same_logits(list(logits), jax_logits(d, target, tokens, steps=STEPS))
