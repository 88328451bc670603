"""`eagle3kit train` through the CLI, runs that must agree: the same global batch on a mesh and
on one device, gradient accumulation and a batch twice the size, bfloat16 and float32.

The target is a tiny random Llama with SmolLM2's real tokenizer; the data are real ShareGPT
conversations rendered with SmolLM2's chat template (tests/assets.train_assets).
"""

from __future__ import annotations

import json
from pathlib import Path

import jax
import numpy as np
import pytest

from eagle3kit.core.draft import DraftWeights
from eagle3kit.core.draft import arrays as draft_arrays
from eagle3kit.core.sharding import init_weights
from eagle3kit.io.draft_io import load_draft
from tests import assets
from tests.cli.test_train import ONE_DEVICE, base_args, invoke, losses


@pytest.fixture(scope="module")
def a():
    return assets.train_assets()


def test_same_batch_on_one_device_and_on_a_mesh(a, fp32_run, tmp_path):
    """The same global batch on data=4,tensor=2 and on one device (fp32_run, the run of
    these settings on data=1,tensor=1): same losses and update."""
    sharded, single = tmp_path / "sharded", fp32_run
    assert invoke(base_args(a, sharded, "--max-steps", "2")).exit_code == 0
    for (s1, l1), (s2, l2) in zip(losses(sharded), losses(single), strict=True):
        assert s1 == s2 and l1 == pytest.approx(l2, rel=1e-5)
    w1, w2 = load_draft(sharded / "final").weights, load_draft(single / "final").weights
    for name in draft_arrays(w1):
        np.testing.assert_allclose(getattr(w1, name), getattr(w2, name), rtol=1e-4, atol=1e-6)


def train_rows(run: Path) -> list[dict]:
    return [r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
            if not r.get("eval")]


@pytest.fixture(scope="module")
def fp32_run(a, tmp_path_factory):
    """Two fp32 steps of 4 rows on one device: the baseline of the equivalences below."""
    out = tmp_path_factory.mktemp("fp32") / "run"
    assert invoke(base_args(a, out, *ONE_DEVICE)).exit_code == 0
    return out



def test_grad_accum_equals_twice_the_rows(a, fp32_run, tmp_path):
    """`--batch-size 2 --grad-accum 2` and `--batch-size 4` see the same 4 rows per step
    (denominators over the whole global batch): same loss, grad_norm and weights, up to
    fp32 summation order."""
    accum = tmp_path / "accum"
    args = base_args(a, accum, *ONE_DEVICE, "--grad-accum", "2")
    args[args.index("--batch-size") + 1] = "2"
    assert invoke(args).exit_code == 0
    for r1, r2 in zip(train_rows(accum), train_rows(fp32_run), strict=True):
        assert r1["step"] == r2["step"]
        assert r1["loss"] == pytest.approx(r2["loss"], rel=1e-5)
        assert r1["grad_norm"] == pytest.approx(r2["grad_norm"], rel=1e-4)
    w1, w2 = load_draft(accum / "final").weights, load_draft(fp32_run / "final").weights
    for name in draft_arrays(w1):
        np.testing.assert_allclose(getattr(w1, name), getattr(w2, name), rtol=1e-4, atol=1e-6)


def _update_cosines(run: Path, baseline: Path) -> dict[str, float]:
    """Per weight, the cosine between the two runs' updates from the same (--seed 0) start."""
    final, other = load_draft(run / "final"), load_draft(baseline / "final")
    start = init_weights(DraftWeights.abstract(final.config), jax.random.key(0))
    out = {}
    for name in draft_arrays(final.weights):
        d1 = np.ravel(getattr(final.weights, name) - np.asarray(getattr(start, name)))
        d2 = np.ravel(getattr(other.weights, name) - np.asarray(getattr(start, name)))
        out[name] = float(d1 @ d2 / (np.linalg.norm(d1) * np.linalg.norm(d2)))
    return out


@pytest.mark.parametrize("target_dtype", ["float32", "bfloat16"])
def test_bfloat16_trains_like_float32(a, fp32_run, tmp_path, target_dtype):
    """`--dtype bfloat16` (the draft's compute; master weights stay fp32), with the target
    in fp32 and in bf16 (the defaults users run), against fp32 on the same batches.

    bf16 keeps 8 significant bits (rounding 2^-9 = 0.2% per value). In the draft's
    compute those errors average out over the ~1000 masked tokens of a step: the loss
    agrees to 1e-3 (measured: 1e-5). A bf16 *target* also moves its argmax wherever its
    top two logits lie within rounding, and this tiny random target's logits are nearly
    flat: about 1% of the positions change whether they are trained at all (argmax in the
    draft vocab or not), each adding or removing a cross-entropy near log(512) over ~1000
    masked tokens, so there the loss agrees to 10% (measured: 5%). Adam's first steps
    are about lr * sign(g) per weight; rounding flips the sign of only the smallest
    gradients, so the update directions agree to a cosine above 0.9, where a broken path
    (gradients cut at a cast, a wrong dtype reaching the optimizer) gives unrelated or
    zero updates."""
    out = tmp_path / "run"
    args = base_args(a, out, *ONE_DEVICE)
    args[args.index("--dtype") + 1] = "bfloat16"
    args[args.index("--target-dtype") + 1] = target_dtype
    assert invoke(args).exit_code == 0
    rel = 1e-3 if target_dtype == "float32" else 0.1
    for r16, r32 in zip(train_rows(out), train_rows(fp32_run), strict=True):
        assert r16["loss"] == pytest.approx(r32["loss"], rel=rel)
    cosines = _update_cosines(out, fp32_run)
    assert min(cosines.values()) > 0.9, cosines


