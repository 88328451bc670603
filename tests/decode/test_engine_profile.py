"""`benchmarks/generate_speed.py --profile` (the GPU session's engine-profile stage) on a CPU:
the traced pass's wall time is split into device time by program and by named scope of the
decode step, idle time inside programs and host time between them. On a CPU the "kernels"
are the XLA ops the host runs, so only the split is checked, not the numbers."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

TINY = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 512,
        "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-5,
        "rope_theta": 10000, "max_position_embeddings": 1024, "tie_word_embeddings": True}


def test_profile_splits_a_decode_step_by_part_and_host_time(tmp_path):
    config = tmp_path / "config.json"
    config.write_text(json.dumps(TINY))
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    r = subprocess.run([sys.executable, "benchmarks/generate_speed.py", "--random-target",
                        str(config), "--prompts", "8", "--prompt-len", "20", "--new", "40",
                        "--slots", "4", "--profile", str(tmp_path / "prof")],
                       capture_output=True, text=True, timeout=600, env=env,
                       cwd=Path(__file__).parents[2])
    assert r.returncode == 0, r.stderr[-3000:]
    out = r.stdout
    # 4 prompts of 40 new tokens in 4 rows: a prefill each, 39 steps in programs of 32 + 7
    assert re.search(r"traced: 6 programs \(2 decode/verify, 4 prefill\), 39 device steps, "
                     r"160 tokens", out), out
    split = re.findall(r"^  (device busy, \w+ programs|device idle inside programs|host "
                       r"between programs)[^\d]*\s+([\d.]+) ms\s+([\d.]+)%$", out, re.M)
    assert [s[0] for s in split[:2]] == ["device busy, step programs",
                                         "device busy, prefill programs"], out
    assert abs(sum(float(s[2]) for s in split) - 100) < 1, split
    parts = dict(re.findall(r"^  (target: [\w /+]+?|lm head \(fp32 logits\)|sampling|row state)"
                            r"\s+([\d.]+) ms", out, re.M))
    for part in ("target: KV cache write", "target: attention", "target: norm + q/k/v + rope",
                 "target: o_proj", "target: norm + MLP", "lm head (fp32 logits)", "sampling",
                 "row state"):
        assert part in parts, f"{part!r} missing from the step's parts:\n{out}"


def test_the_roofline_adds_the_prefill_at_peak_to_the_decode_steps_bandwidth_bound():
    from benchmarks.generate_speed import bounds

    from eagle3kit.core.config import TargetConfig

    cfg = TargetConfig.from_hf_config(TINY)
    wb, bw, peak, slots, new = 1e6, 1e12, 1e15, 4, 40
    # a decode step reads the weights and 4 rows of (prompt 20 + 20 mean new) keys, values
    kv = 2 * 2 * 2 * 16 * 2  # K and V x layers x KV heads x head dim x bf16
    step_s = (wb + slots * kv * (20 + new / 2)) / bw
    bound, roofline = bounds(cfg, wb, [20] * 8, new, slots, bandwidth=bw, peak_flops=peak)
    assert bound == pytest.approx(slots / step_s, rel=1e-12)
    # each prompt token: 2 FLOPs per layer matmul weight (no lm head), and attention to the
    # causal half of its prompt
    layer_params = 2 * (64 * (64 + 2 * 32) + 64 * 64) + 2 * 3 * 64 * 128
    prefill_s = 8 * 20 * (2 * layer_params + 2 * 2 * 4 * 16 * 2 * 10) / peak
    assert 8 * new / roofline == pytest.approx(8 * new / bound + prefill_s, rel=1e-12)
    # four data devices: four steps at once, a quarter of the rows each, prefill split too
    bound4, roofline4 = bounds(cfg, wb, [20] * 8, new, slots, data=4, bandwidth=bw,
                               peak_flops=peak)
    assert bound4 == pytest.approx(slots * bw / (wb + slots / 4 * kv * (20 + new / 2)),
                                   rel=1e-12)
    assert 8 * new / roofline4 == pytest.approx(8 * new / bound4 + prefill_s / 4, rel=1e-12)


def test_the_bandwidth_bound_counts_an_untied_embedding_as_a_step_reads_it():
    """A decode step gathers its rows' entries of an untied embedding table and reads its own
    lm head whole; a tied table is the lm head, read whole once."""
    import jax
    import jax.numpy as jnp
    from benchmarks.generate_speed import step_weight_bytes

    from eagle3kit.core.config import TargetConfig
    from eagle3kit.core.sharding import init_weights
    from eagle3kit.core.target import TargetWeights

    for tied in (True, False):
        cfg = TargetConfig.from_hf_config({**TINY, "tie_word_embeddings": tied})
        w = init_weights(TargetWeights.abstract(cfg, jnp.bfloat16), jax.random.key(0))
        total = sum(a.nbytes for a in jax.tree.leaves(w))
        embed = 512 * 64 * 2
        assert step_weight_bytes(w) == (total if tied else total - embed)
        assert (w.lm_head is None) == tied
