"""P-EAGLE's training pass (core/peagle.block_logits: every anchor, every depth, TTT's blockwise
attention) computes exactly what its one-pass forward (core/peagle.forward, the one checked
against speculators' own model in tests/formats/test_peagle_library.py) computes on the same
blocks laid out as speculators lays them out, across two packed documents; and the trainer
scores a P-EAGLE draft with that pass."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from eagle3kit.core import peagle, ttt
from eagle3kit.core.metrics import summarize
from eagle3kit.core.optim import OptimConfig
from eagle3kit.core.sharding import make_mesh
from eagle3kit.core.trainer import Trainer
from tests.formats.helpers import peagle_draft, tiny_target

K = 4


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return tiny_target(tmp_path_factory.mktemp("target"))


@pytest.mark.parametrize("num_layers", [1, 2])
def test_training_pass_equals_the_one_pass_forward(target, num_layers):
    d = peagle_draft(target, num_layers, fc_norm=True, seed=1)
    t = 12
    rng = np.random.default_rng(0)
    seg = np.array([[1] * 7 + [2] * 5])  # two documents packed in one row
    batch = ttt.Batch(tokens=jnp.asarray(rng.integers(0, 96, (1, t)), jnp.int32),
                      loss_mask=jnp.ones((1, t), jnp.int32), segment_ids=jnp.asarray(seg),
                      positions=jnp.asarray([list(range(7)) + list(range(5))]))
    vocab = ttt.VocabArrays.from_map(d.vocab)
    sig = ttt.target_signals(target.weights, target.ckpt.config, d.config, vocab, batch)
    w = jax.tree.map(jnp.asarray, d.weights)
    cfg = ttt.TTTConfig(steps=K, compute_dtype=jnp.float32, attention_block=4)
    got = np.stack([np.asarray(x[0]) for x in peagle.block_logits(w, d.config, sig, batch, cfg)])

    anchor = np.tile(np.arange(t), K)
    depth = np.repeat(np.arange(K), t)
    expected = peagle.forward(
        w, d.config, ttt.shift(batch.tokens, 1)[:, anchor], sig.aux_BxTxA[:, anchor],
        jnp.asarray(depth == 0)[None], (batch.positions[0, anchor] + depth)[None],
        peagle.block_mask(jnp.asarray(anchor), jnp.asarray(depth), batch.segment_ids[0])[None])
    expected = np.asarray(expected[0]).reshape(K, t, -1)
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5 * np.abs(expected).max())

    loss, counts = peagle.rollout(w, d.config, sig, batch, vocab, cfg,
                                  ttt.valid_counts(batch, K))
    assert np.isfinite(float(loss)) and len(summarize(counts)["acc"]) == K
    # the trainer (train, eval --data) scores a P-EAGLE draft with this pass, not TTT's
    trainer = Trainer(target.ckpt.config, d.config, cfg, OptimConfig(),
                      make_mesh("data=1,tensor=1", jax.devices()[:1]))
    via = trainer.eval_step(w, target.weights, vocab, batch)
    np.testing.assert_allclose(np.asarray(via.ce_sum), np.asarray(counts.ce_sum), rtol=1e-5)
