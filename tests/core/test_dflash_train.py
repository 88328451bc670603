"""DFlash training through eagle3kit's own target: anchors drawn per row, the loss's
denominator, the counts, and gradients (none into the frozen head)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from eagle3kit.core import dflash, dflash_train, ttt
from eagle3kit.core.config import DraftConfig
from eagle3kit.core.sharding import init_weights, make_mesh
from eagle3kit.core.vocab import VocabMap
from eagle3kit.io.hf import load_target, resolve_target
from tests import assets
from tests.core.test_ttt import packed_batch


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny")
    assets.tiny_hf_model("llama", path)
    ckpt = resolve_target(path)
    tw = load_target(ckpt, make_mesh("data=1", jax.devices()[:1]), jnp.float32)
    dcfg = dataclasses.replace(DraftConfig.for_target(ckpt.config, draft_vocab_size=64),
                               method="dflash", num_layers=2, block_size=4, mask_token_id=95)
    w = init_weights(dflash.DFlashWeights.abstract(dcfg), jax.random.key(0))
    vocab = VocabMap.from_ids(np.r_[np.arange(1, 96, 2), np.arange(0, 32, 2)], 96)
    return ckpt.config, tw, dcfg, w, ttt.VocabArrays.from_map(vocab)


def loss(setup, w, batch, tc):
    tcfg, tw, dcfg, _, vocab = setup
    den = dflash_train.valid_counts(batch, dcfg, tc)
    return dflash_train.loss_fn(w, tw, batch, vocab, den, tcfg=tcfg, dcfg=dcfg, ttt=tc)


TC = ttt.TTTConfig(steps=3, compute_dtype=jnp.float32, anchors=5)


def test_anchors_follow_the_row_and_count_the_trained_slots(setup):
    _, _, dcfg, _, _ = setup
    batch = packed_batch(np.random.default_rng(0))
    cols, valid = dflash_train.row_anchors(batch, dcfg, 5)
    swapped = jax.tree.map(lambda x: x[::-1], batch)
    cols2, valid2 = dflash_train.row_anchors(swapped, dcfg, 5)
    np.testing.assert_array_equal(cols[::-1], cols2)  # a row's anchors are its own
    trained = dflash_train.slot_masks(cols, valid, batch.loss_mask, batch.segment_ids, 4)
    assert float(dflash_train.valid_counts(batch, dcfg, TC)[0]) == int(trained.sum()) > 0


def test_counts_and_loss_agree_and_the_head_stays_frozen(setup):
    _, _, _, w, _ = setup
    batch = packed_batch(np.random.default_rng(1))
    (value, counts), grads = jax.value_and_grad(
        lambda w: loss(setup, w, batch, TC), has_aux=True)(w)
    assert counts.total.shape == (3,) and float(counts.total.sum()) == float(
        dflash_train.valid_counts(batch, setup[2], TC)[0])
    assert float(jnp.abs(grads.lm_head).max()) == 0.0
    assert all(float(jnp.abs(getattr(grads, f)).max()) > 0 for f in
               ("fc", "hidden_norm", "q", "k", "v", "o", "q_norm", "k_norm", "gate", "down",
                "final_norm", "input_norm", "post_attn_norm", "up"))
    # with KL the loss is the decayed soft cross-entropy over the trained slots
    weights = dflash_train.decay_weights(4, dflash_train.GAMMA)[1:]
    np.testing.assert_allclose(float(value), float((counts.ce_sum * weights).sum()
                                                    / counts.total.sum()), rtol=1e-5)
