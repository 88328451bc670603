"""The speculators library's own Eagle3 model loads the speculators export and computes
eagle3kit's draft logits. Skipped where `speculators` is not installed (it pulls torchvision,
torchaudio and openai, so it is not a test dependency); run it with

    pip install --no-deps speculators loguru pydantic-settings openai sniffio hs-connectors
    pytest tests/formats/test_speculators_library.py
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from eagle3kit.formats import export_draft
from tests.formats.helpers import jax_logits, make_draft

speculators = pytest.importorskip("speculators.models.eagle3")


@pytest.mark.parametrize("aux,nbr,arch", [(None, False, "eagle3"), ((5, 1, 3), True, "eagle3"),
                                          (None, True, "eagle3.1")])
def test_speculators_model_gives_eagle3kit_logits(target, tokens, tmp_path, aux, nbr, arch):
    from safetensors.torch import load_file

    tokens = tokens[:1]  # the library's forward takes one packed row
    d = make_draft(target, aux_layer_ids=aux, norm_before_residual=nbr, seed=3, arch=arch)
    # the verifier is the local tiny target: the library loads its embedding from there
    out = export_draft(d, "speculators", tmp_path / "v", dtype="float32",
                       target_name=str(target.directory))
    cfg = speculators.Eagle3SpeculatorConfig.from_pretrained(out)
    assert cfg.transformer_layer_config.model_type == "llama"
    assert cfg.norm_before_residual is nbr
    assert (cfg.fc_norm, cfg.norm_output) == (d.config.fc_norm, d.config.norm_output)
    cfg.transformer_layer_config._attn_implementation = "eager"  # flex attention needs a GPU
    model = speculators.Eagle3DraftModel.from_pretrained(out, config=cfg).eval()
    written, held = load_file(str(out / "model.safetensors")), model.state_dict()
    assert set(written) <= set(held)  # every tensor lands in a parameter or buffer
    # and every trainable parameter but the target-owned embedding comes from the export
    assert {k for k, p in model.named_parameters() if p.requires_grad} <= set(written)
    assert all(torch.equal(held[k].float(), v.float()) for k, v in written.items())
    with torch.no_grad():
        model.embed_tokens.weight.copy_(target.model.get_input_embeddings().weight)
        states = target.model(torch.tensor(tokens), output_hidden_states=True).hidden_states
    aux_states = torch.cat([states[i] for i in cfg.eagle_aux_hidden_state_layer_ids], -1)
    logits = []
    hook = model.lm_head.register_forward_hook(lambda m, i, o: logits.append(o))
    with torch.no_grad():
        model(aux_states, torch.tensor(tokens), torch.zeros_like(torch.tensor(tokens)),
              position_ids=torch.arange(tokens.shape[1]).expand(tokens.shape), ttt_steps=1)
    hook.remove()
    expected = jax_logits(d, target, tokens, steps=1)[0][..., d.vocab.used_ids]
    got = logits[0].numpy()
    assert np.abs(got - expected).max() <= 2e-4 * np.abs(expected).max()
