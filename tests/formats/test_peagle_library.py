"""P-EAGLE against the peers' own model code: speculators 0.9.0's `PEagleDraftModel` loads
eagle3kit's speculators export with no missing or unexpected tensor and computes, on the same
sampled blocks, the logits of eagle3kit's one-pass forward (core/peagle.py), fp32 on CPU."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from eagle3kit.core import peagle
from eagle3kit.core.draft import arrays
from eagle3kit.formats import export_draft, load_any_draft
from tests.formats.helpers import peagle_draft

core = pytest.importorskip("speculators.models.peagle.core")


# blocks of depth 0..3 from anchors as COD sampling draws them (a column's position is
# anchor + depth); fixed here so both sides see the same ones
ANCHOR = np.array([0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 1, 2, 4, 7, 8, 2, 4, 7, 4])
DEPTH = np.array([0] * 11 + [1] * 5 + [2] * 3 + [3])


@pytest.mark.parametrize("num_layers,fc_norm", [(1, False), (2, True)])
def test_speculators_peagle_model_gives_eagle3kit_logits(target, tokens, tmp_path, monkeypatch,
                                                         num_layers, fc_norm):
    from safetensors.torch import load_file
    from speculators.models.peagle import PEagleSpeculatorConfig

    d = peagle_draft(target, num_layers, fc_norm)
    out = export_draft(d, "speculators", tmp_path / "v", dtype="float32",
                       target_name=str(target.directory))
    cfg = PEagleSpeculatorConfig.from_pretrained(out)
    assert (cfg.mask_token_id, cfg.fc_norm, cfg.transformer_layer_config.num_hidden_layers) \
        == (7, fc_norm, num_layers)
    cfg.transformer_layer_config._attn_implementation = "eager"  # flex attention needs a GPU
    model = core.PEagleDraftModel.from_pretrained(out, config=cfg).eval()
    written, held = load_file(str(out / "model.safetensors")), model.state_dict()
    assert set(written) <= set(held)
    # every trainable parameter comes from the export (the verifier's head is not the draft's)
    assert {k for k, p in model.named_parameters() if not k.startswith("verifier_")} \
        <= set(written)
    assert all(torch.equal(held[k].float(), v.float()) for k, v in written.items())
    back = load_any_draft(out, target=str(target.directory))
    assert back.config == d.config
    for field, value in arrays(d.weights).items():
        np.testing.assert_array_equal(getattr(back.weights, field), value, err_msg=field)

    row = tokens[:1]
    with torch.no_grad():
        states = target.model(torch.tensor(row), output_hidden_states=True).hidden_states
    aux = torch.cat([states[i] for i in cfg.eagle_aux_hidden_state_layer_ids], -1)
    monkeypatch.setattr(core, "generate_cod_sample_indices",
                        lambda **_: (torch.tensor(ANCHOR), torch.tensor(DEPTH)))
    logits = []
    hook = model.lm_head.register_forward_hook(lambda m, i, o: logits.append(o))
    from speculators.losses.eager import kl_div_loss

    with torch.no_grad():
        model(aux, torch.tensor(row), torch.zeros_like(torch.tensor(row)), num_depths=4,
              verifier_last_hidden_states=torch.randn(1, row.shape[1], aux.shape[-1] // 3),
              loss_config={"kl_div": (kl_div_loss, 1.0)})  # eager: the fused one needs Triton
    hook.remove()

    pos = ANCHOR + DEPTH
    w = jax.tree.map(jnp.asarray, d.weights)
    got = peagle.forward(w, d.config, jnp.asarray(row[:, pos]), jnp.asarray(aux.numpy()[:, pos]),
                         jnp.asarray(DEPTH == 0)[None], jnp.asarray(pos)[None],
                         peagle.block_mask(jnp.asarray(ANCHOR), jnp.asarray(DEPTH),
                                           jnp.ones(row.shape[1], jnp.int32))[None])
    expected = logits[0].numpy()
    assert np.abs(np.asarray(got) - expected).max() <= 2e-4 * np.abs(expected).max()
