"""DFlash's forward and training loss against the peers' own torch code (fp32, CPU, tiny
random configs): speculators 0.9.0's `DFlashDraftModel` (the anchored training forward, its
targets, masks and loss) and SpecForge 0.2.0's (the cached decoding forward, two rounds)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from eagle3kit.core import dflash, dflash_train
from eagle3kit.core import losses as eagle_losses
from eagle3kit.core.config import DraftConfig, RopeConfig

torch = pytest.importorskip("torch")

V, D, F, N, K, H = 96, 64, 128, 4, 2, 16


def config(layers: int = 2, block: int = 4, draft_vocab: int = V) -> DraftConfig:
    return DraftConfig(hidden_size=D, intermediate_size=F, num_heads=N, num_kv_heads=K,
                       head_dim=H, vocab_size=V, draft_vocab_size=draft_vocab,
                       target_hidden_size=D, aux_layer_ids=(1, 3, 4), rms_norm_eps=1e-6,
                       rope=RopeConfig(theta=10000.0), max_position_embeddings=256,
                       method="dflash", num_layers=layers, block_size=block, mask_token_id=V - 1)


def qwen3(cfg: DraftConfig):
    from transformers import Qwen3Config
    c = Qwen3Config(vocab_size=V, hidden_size=D, intermediate_size=F,
                    num_hidden_layers=cfg.num_layers, num_attention_heads=N,
                    num_key_value_heads=K, head_dim=H, rms_norm_eps=1e-6,
                    max_position_embeddings=256, rope_theta=10000.0)
    c._attn_implementation = "eager"
    return c


def randomize(module, seed: int) -> dict[str, np.ndarray]:
    """Random weights everywhere (norm gains too, so a misplaced norm shows) -> state dict."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in module.named_parameters():
            scale, shift = (0.5, 0.0) if p.ndim == 2 else (0.2, 1.0)
            p.copy_(torch.randn(p.shape, generator=gen) * scale + shift)
    return {k: v.detach().numpy() for k, v in module.state_dict().items()}


def weights(cfg: DraftConfig, sd: dict[str, np.ndarray]) -> dflash.DFlashWeights:
    """eagle3kit weights from a peer's state dict, through the export key table."""
    abstract = dflash.DFlashWeights.abstract(cfg)
    values: dict[str, np.ndarray] = {}
    for key in dflash.export_keys("speculators", cfg):
        shape = getattr(abstract, key.field).shape
        inner = shape if key.index is None else shape[1:]
        value = sd[key.name] if key.n_in == 0 else sd[key.name].T.reshape(inner)
        if key.index is None:
            values[key.field] = value
        else:
            values.setdefault(key.field, np.zeros(shape, np.float32))[key.index] = value
    return dflash.DFlashWeights(**{k: jnp.asarray(v) for k, v in values.items()})


def speculators_model(cfg: DraftConfig, seed: int = 0):
    from speculators.models.dflash import DFlashDraftModel, DFlashSpeculatorConfig
    spec = DFlashSpeculatorConfig(transformer_layer_config=qwen3(cfg), draft_vocab_size=V,
                                  block_size=cfg.block_size,
                                  aux_hidden_state_layer_ids=list(cfg.aux_layer_ids),
                                  mask_token_id=cfg.mask_token_id)
    model = DFlashDraftModel(spec).eval()
    return model, randomize(model, seed)


@pytest.fixture
def packed():
    """One row of T tokens, the first five untrained, and fixed anchors."""
    rng = np.random.default_rng(0)
    t = 24
    return dict(tokens=rng.integers(0, V - 1, (1, t)),
                aux=rng.standard_normal((1, t, 3 * D)).astype(np.float32),
                last=rng.standard_normal((1, t, D)).astype(np.float32),
                loss_mask=np.r_[np.zeros(5), np.ones(t - 5)].astype(np.int64)[None],
                anchors=np.array([5, 9, 10, 17]))


def speculators_backbone(model, packed, monkeypatch):
    import speculators.models.dflash.core as core
    anchors = torch.tensor(packed["anchors"])
    monkeypatch.setattr(core, "select_anchors",
                        lambda *_: (anchors, torch.ones(len(anchors), dtype=torch.bool)))
    with torch.no_grad():
        return model._backbone_forward(
            torch.tensor(packed["aux"]), torch.tensor(packed["tokens"]),
            torch.tensor(packed["loss_mask"]), torch.tensor(packed["last"]),
            torch.zeros(packed["tokens"].shape, dtype=torch.long),
            max_anchors=len(anchors))


def eagle_logits(cfg, w, sd, packed):
    t = packed["tokens"].shape[1]
    emb = jnp.asarray(sd["embed_tokens.weight"])
    return dflash_train.anchored_forward(
        w, cfg, jnp.asarray(packed["aux"]), lambda tok: emb[tok],
        jnp.asarray(sd["lm_head.weight"].T), jnp.asarray(packed["tokens"]),
        jnp.arange(t)[None], jnp.ones((1, t), jnp.int32), jnp.asarray(packed["anchors"])[None])


def test_anchored_forward_equals_speculators(packed, monkeypatch):
    cfg = config()
    model, sd = speculators_model(cfg)
    _, logits, _, _, _ = speculators_backbone(model, packed, monkeypatch)
    ours = eagle_logits(cfg, weights(cfg, sd), sd, packed)
    np.testing.assert_allclose(np.asarray(ours), logits.numpy(), rtol=1e-5, atol=1e-4)


def verifier_probs(sd, last):
    x = last / np.sqrt((last ** 2).mean(-1, keepdims=True) + 1e-6) * sd["verifier_norm.weight"]
    return jax.nn.softmax(jnp.asarray(x @ sd["verifier_lm_head.weight"].T), axis=-1)


@pytest.mark.parametrize("name", ["kl_div", "tv"])
def test_targets_masks_and_loss_equal_speculators(packed, monkeypatch, name):
    from speculators.losses import resolve_loss_config
    from speculators.models.dflash.metrics import compute_metrics
    cfg = config()
    model, sd = speculators_model(cfg)
    _, logits, targets, mask, _ = speculators_backbone(model, packed, monkeypatch)
    p, n = len(packed["anchors"]), cfg.block_size
    anchors = jnp.asarray(packed["anchors"])[None]
    target_p = dflash_train.slot_targets(verifier_probs(sd, packed["last"]), anchors, n)
    np.testing.assert_allclose(
        np.asarray(target_p)[:, :, 1:],
        jax.nn.softmax(targets.numpy().reshape(1, p, n, V), axis=-1)[:, :, 1:], atol=1e-6)
    trained = dflash_train.slot_masks(anchors, jnp.ones((1, p), bool),
                                      jnp.asarray(packed["loss_mask"]),
                                      jnp.ones(packed["tokens"].shape, jnp.int32), n)
    np.testing.assert_array_equal(np.asarray(trained).reshape(1, -1), mask.numpy() > 0)
    reference, _ = compute_metrics(logits, targets, mask, n, gamma=4.0,
                                   loss_config=resolve_loss_config(name, "eager"))
    ours_logits = jnp.asarray(logits.numpy()).reshape(1, p, n, V)
    denominator = trained.sum() + 1e-5  # speculators' reduction
    # eagle3kit's "kl" is the soft cross-entropy: KL plus p's entropy, the same gradient
    per = (eagle_losses.total_variation if name == "tv" else eagle_losses.kl_divergence)(
        ours_logits, target_p)
    ours = dflash_train.block_loss(per, trained, dflash_train.GAMMA, denominator)
    np.testing.assert_allclose(float(ours), float(reference), rtol=1e-5)


def test_cached_decoding_equals_specforge():
    """Two drafting rounds through SpecForge's own cache (context keys kept, the block's
    cropped) against eagle3kit's per-layer context keys."""
    from specforge.modeling.draft.dflash import DFlashDraftModel
    from transformers import DynamicCache
    cfg = config(block=4)
    c = qwen3(cfg)
    c.block_size, c.num_target_layers = cfg.block_size, 6
    c.dflash_config = {"target_layer_ids": [i - 1 for i in cfg.aux_layer_ids],
                       "mask_token_id": cfg.mask_token_id}
    model = DFlashDraftModel(c).eval()
    sd = randomize(model, 1)
    w = weights(cfg, sd)
    rng = np.random.default_rng(1)
    n, s1, accepted = cfg.block_size, 7, 2
    s2 = s1 + accepted + 1
    ctx1, ctx2 = (rng.standard_normal((1, s, 3 * D)).astype(np.float32) for s in (s1, s2 - s1))
    noise1, noise2 = (rng.standard_normal((1, n, D)).astype(np.float32) for _ in range(2))
    pos, cache = torch.arange(64)[None], DynamicCache()
    with torch.no_grad():
        out1 = model(target_hidden=torch.tensor(ctx1), noise_embedding=torch.tensor(noise1),
                     position_ids=pos[:, :s1 + n], past_key_values=cache, use_cache=True)
        cache.crop(-n)  # the block's keys go; the context's stay
        out2 = model(target_hidden=torch.tensor(ctx2), noise_embedding=torch.tensor(noise2),
                     position_ids=pos[:, s1:s2 + n], past_key_values=cache, use_cache=True)
    kv = dflash.all_context_kv(w, cfg, dflash.context(w, cfg, jnp.concatenate([ctx1, ctx2], 1)),
                               jnp.arange(s2)[None])
    for noise, start, ref in ((noise1, s1, out1), (noise2, s2, out2)):
        mask = jnp.broadcast_to(jnp.arange(s2) < start, (1, n, s2))
        ours = dflash.forward(w, cfg, jnp.asarray(noise), (start + jnp.arange(n))[None], kv, mask)
        np.testing.assert_allclose(np.asarray(ours), ref.numpy(), rtol=1e-5, atol=1e-5)


def test_anchors_are_distinct_trained_columns_outside_the_last_block():
    t, n = 20, 4
    mask = np.zeros((3, t), np.int32)
    mask[0, 2:] = 1  # 14 eligible columns: 2..15
    mask[1, [3, 7]] = 1  # two eligible
    mask[2, t - n:] = 1  # only the last block: none
    cols, valid = dflash_train.sample_anchors(jax.random.key(0), jnp.asarray(mask), 6, n)
    cols, valid = np.asarray(cols), np.asarray(valid)
    assert valid.sum(1).tolist() == [6, 2, 0]
    assert len(set(cols[0])) == 6 and all(2 <= c < t - n for c in cols[0])
    assert cols[1][valid[1]].tolist() == [3, 7]
    assert all(np.diff(c[v]).min(initial=1) > 0 for c, v in zip(cols, valid, strict=True))


def test_a_block_sees_only_its_own_document_before_its_anchor():
    cfg = config(layers=1)
    w = dflash.cast(jax.tree.map(jnp.asarray, jax.tree.map(
        lambda i: np.random.default_rng(2).standard_normal(i.shape).astype(np.float32) * 0.3,
        dflash.DFlashWeights.abstract(cfg), is_leaf=lambda x: hasattr(x, "axes"))), jnp.float32)
    t = 16
    seg = jnp.asarray([[1] * 6 + [2] * 10])
    pos = jnp.asarray([list(range(6)) + list(range(10))])
    tokens = jnp.arange(t)[None] % (V - 1)
    aux = jax.random.normal(jax.random.key(3), (1, t, 3 * D))
    emb = jax.random.normal(jax.random.key(4), (V, D))
    anchors = jnp.asarray([[3, 9]])

    def logits(aux):
        return dflash_train.anchored_forward(w, cfg, aux, lambda x: emb[x], emb.T, tokens, pos,
                                             seg, anchors)

    base = logits(aux)
    # document 1 changed: block 2 (anchor 9, document 2) must not move; the context at and
    # after each anchor must not move either block
    for cols, moved in (([0, 1, 2], [True, False]), ([3, 4, 5, 9, 12], [False, False]),
                        ([6, 8], [False, True])):
        out = logits(aux.at[:, cols].add(1.0))
        diff = np.abs(np.asarray(out - base)).reshape(2, -1).max(1) > 1e-6
        assert diff.tolist() == moved, cols
    trained = dflash_train.slot_masks(jnp.asarray([[3]]), jnp.ones((1, 1), bool),
                                      jnp.ones((1, t), jnp.int32), seg, cfg.block_size)
    assert np.asarray(trained)[0, 0].tolist() == [False, True, True, False]


def test_export_keys_say_what_each_format_holds():
    full, reduced = config(), dataclasses.replace(config(), draft_vocab_size=40)
    names = [k.name for k in dflash.export_keys("speculators", full)]
    assert "lm_head.weight" not in names and "layers.1.mlp.down_proj.weight" in names
    assert dflash.export_keys("speculators", reduced)[-1].name == "lm_head.weight"
    assert dflash.export_keys("sglang", full) is not None
    assert dflash.export_keys("sglang", reduced) is None


def test_acceptance_counts_equal_speculators_metrics():
    """Per-slot accuracy and tau against speculators' position accuracies and `eal` (the
    mean accepted run plus the bonus token), on logits that agree with the target's at about
    half the slots."""
    from speculators.losses import resolve_loss_config
    from speculators.models.dflash.metrics import compute_metrics

    from eagle3kit.core.metrics import summarize
    p, n = 50, 4
    rng = np.random.default_rng(5)
    logits = rng.standard_normal((1, p * n, V)).astype(np.float32)
    targets = logits + 2.0 * rng.standard_normal(logits.shape).astype(np.float32)
    mask = np.ones((1, p * n), np.float32)
    mask[:, ::n] = 0  # the anchor slots
    _, metrics = compute_metrics(torch.tensor(logits), torch.tensor(targets),
                                 torch.tensor(mask), n,
                                 loss_config=resolve_loss_config("kl_div", "eager"))
    trained = jnp.asarray(mask.reshape(1, p, n) > 0)
    counts = dflash_train.block_counts(
        jnp.asarray(logits).reshape(1, p, n, V), jnp.asarray(targets.argmax(-1)).reshape(1, p, n),
        trained, jnp.zeros((1, p, n)), jnp.arange(V))
    for i in range(1, n):
        assert float(counts.correct[i - 1]) == float(metrics[f"position_{i}_acc_sum"])
        assert float(counts.total[i - 1]) == float(metrics[f"position_{i}_acc_total"])
    assert 0 < float(counts.correct.sum()) < float(counts.total.sum())
    np.testing.assert_allclose(summarize(counts)["tau"],
                               float(metrics["eal_sum"] / metrics["eal_total"]), rtol=1e-6)
