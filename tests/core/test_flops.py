"""Model FLOPs per token by the convention of docs/benchmarks.md, against hand counts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from eagle3kit.core import flops
from eagle3kit.core.config import DraftConfig, TargetConfig

CONFIGS = Path(__file__).parents[2] / "benchmarks" / "configs"


def test_llama_8b_shape_is_31_9_gflop_per_token():
    tcfg = TargetConfig.from_hf_config(
        json.loads((CONFIGS / "llama-3.1-8b-instruct.json").read_text()))
    dcfg = DraftConfig.for_target(tcfg, 32000)
    # by hand: target 2 * (32 layers * 218.1M + lm_head 525.3M) + attention 4 * 1024 * 4096
    # * 32; draft 7 * (6 * 374.3M + 3 * 4 * 1024 * 4096) + fc 6 * 12288 * 4096
    target = 2 * (32 * (4096 * 6144 + 4096 * 4096 + 3 * 4096 * 14336) + 4096 * 128256)
    target += 32 * 4 * 1024 * 4096
    step = 6 * (8192 * 6144 + 4096 * 4096 + 3 * 4096 * 14336 + 4096 * 32000) + 3 * 4 * 1024 * 4096
    expected = target + 7 * step + 6 * 12288 * 4096
    got = flops.flops_per_token(tcfg, dcfg, 2048, 7)
    assert got == pytest.approx(expected, rel=1e-12)
    assert got / 1e9 == pytest.approx(31.92, abs=0.01)


def test_mfu_by_device_kind():
    assert flops.mfu(494.5e12, "NVIDIA H200") == pytest.approx(0.5)
    assert flops.mfu(494.5e12, "NVIDIA H100 80GB HBM3") == pytest.approx(0.5)
    assert flops.mfu(1e12, "cpu") is None
