"""SpecForge's own `LlamaForCausalLMEagle3` (the training code beside SGLang) loads eagle3kit's
SGLang exports, EAGLE3 and EAGLE-3.1, with no missing or unexpected tensor, and computes
eagle3kit's first-step draft logits at fp32. (SpecForge 0.2.0 reads `norm_output` in another
sense than SGLang, so only the first step is compared for `eagle3.1`; SGLang's own model code,
test_sglang_library.py, runs the later steps.) `make test` installs specforge without
its dependencies (only its model code is imported); skipped where it is not installed.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from eagle3kit.formats import export_draft
from tests.formats.helpers import jax_logits, make_draft

eagle = pytest.importorskip("specforge.modeling.draft.llama3_eagle")


@pytest.mark.parametrize("arch", ["eagle3", "eagle3.1", "eagle3.1-fc"])
def test_specforge_model_gives_eagle3kit_logits(target, tokens, tmp_path, arch):
    d = make_draft(target, arch=arch, seed=5)
    out = export_draft(d, "sglang", tmp_path / "s", dtype="float32")
    from safetensors.torch import load_file
    from transformers import LlamaConfig

    # built on the CPU as SpecForge builds its draft (from_pretrained's meta-device init
    # leaves the rotary caches of SpecForge's attention uninitialised), then loaded strictly
    model = eagle.LlamaForCausalLMEagle3(LlamaConfig.from_pretrained(out)).float().eval()
    info = model.load_state_dict(load_file(str(out / "model.safetensors")), strict=False)
    # SGLang embeds with the target's embedding: the one tensor an export never carries
    assert info.missing_keys == ["embed_tokens.weight"] and not info.unexpected_keys
    assert (model.fc_norm is not None) is (arch != "eagle3")
    b, n = tokens.shape
    with torch.no_grad():
        states = target.model(torch.tensor(tokens), output_hidden_states=True).hidden_states
        aux = torch.cat([states[i] for i in d.config.aux_layer_ids], -1)
        embeds = target.model.get_input_embeddings()(torch.tensor(tokens))
        mask = eagle.prepare_decoder_attention_mask(
            torch.ones((b, n), dtype=torch.bool), (b, n), aux, 0)
        h = model.backbone(embeds, model.project_hidden_states(aux), None, mask,
                           torch.arange(n).expand(b, n), use_cache=False)
        got = model.compute_logits(h).numpy()
    expected = jax_logits(d, target, tokens, steps=1)[0][..., d.vocab.used_ids]
    assert np.abs(got - expected).max() <= 2e-4 * np.abs(expected).max()

