"""`jax.eval_shape` memory estimates of full-size MoE and Gemma training steps
(benchmarks/memory_estimate.py): nothing is allocated, so the published 20-30B shapes run in CI.

The parameter counts are the models' published totals, which pins the abstract weights of
each family (a missing expert stack, a wrong expert width, a lost dense layer show here).
"""

from __future__ import annotations

import pytest
from benchmarks.memory_estimate import estimate

CONFIGS = "benchmarks/configs/"


@pytest.mark.parametrize("config,params,active", [
    ("qwen3-30b-a3b.json", 30.5, 3.35),  # Qwen3-30B-A3B: 30.5B total
    ("gpt-oss-20b.json", 20.9, 4.19),  # gpt-oss-20b: 20.9B total
    ("gemma-3-27b-it.json", 27.0, 27.0),
])
def test_full_size_steps_fit_one_h200(config, params, active):
    r = estimate(CONFIGS + config, batch=4, seq_len=2048, steps=7, draft_vocab=32000,
                 mesh_spec="data=1,tensor=1", compile_step=False)
    assert r["params_B"] == pytest.approx(params, abs=0.05)
    assert r["active_params_B"] == pytest.approx(active, abs=0.05)
    # bf16 target weights: 2 bytes per parameter (to the rounding of the biases we do not count)
    assert r["target_weights_GiB"] * 2**30 == pytest.approx(2 * params * 1e9, rel=0.01)
    assert r["total_GiB"] < 141 * 1e9 / 2**30 / 2  # weights and state leave half an H200


def test_experts_split_over_the_mesh():
    one = estimate(CONFIGS + "qwen3-30b-a3b.json", 4, 2048, 7, 32000, "data=1,tensor=1", False)
    eight = estimate(CONFIGS + "qwen3-30b-a3b.json", 4, 2048, 7, 32000, "data=2,tensor=4",
                     False)
    # everything but the small replicated norms and router is split 4 ways
    assert eight["target_weights_GiB"] < one["target_weights_GiB"] / 4 * 1.02


def test_full_size_configs_read_their_layer_patterns():
    import json

    from eagle3kit.core.config import TargetConfig

    def read(name):
        return TargetConfig.from_hf_config(json.loads(open(CONFIGS + name).read()))

    gemma = read("gemma-3-27b-it.json")  # transformers 4.x fields: pattern and local base
    assert gemma.layer_windows[:6] == (1024,) * 5 + (0,) and len(gemma.layer_windows) == 62
    assert gemma.layer_rope_index()[:6] == (1,) * 5 + (0,)
    assert (gemma.local_rope.theta, gemma.rope.kind, gemma.rope.factor) == (1e4, "linear", 8)
    oss = read("gpt-oss-20b.json")
    assert oss.layer_windows[:2] == (128, 0) and oss.moe.top_k == 4 and oss.rope.kind == "yarn"
    moe = read("qwen3-30b-a3b.json")
    assert moe.moe.sparse_layers == (True,) * 48 and moe.moe.expert_size == 768
