"""`eagle3kit eval` through the CLI on the real SmolLM2-135M-Instruct (its GGUF) with a draft
trained for it (tests/smollm2_draft.py): MT-bench by speculative decoding reproduces the
target's greedy answers, and the summary adds up (slow)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from tests import assets, smollm2_draft
from tests.cli.test_eval import FP32, invoke


@pytest.mark.slow
def test_mt_bench_on_real_smollm2_reproduces_greedy_decoding(smollm2_trained_draft, tmp_path):
    """Both MT-bench turns of question 81 on the real target; turn 1 must be the target's own
    greedy answer (fp32), and the trained draft must get runs of tokens accepted."""
    d = smollm2_trained_draft
    samples = tmp_path / "samples.jsonl"
    r = invoke(["eval", "--target", assets.smollm2_gguf(), "--draft", d.path,
                "--prompts", "mt-bench", "--limit", 1, "--steps", 5,
                "--max-new-tokens", smollm2_draft.ANSWER_TOKENS, *FP32, "--json",
                "--samples", samples])
    assert r.exit_code == 0, r.output
    result = json.loads(r.stdout)
    records = [json.loads(line) for line in samples.read_text().splitlines()]
    assert [s["turn"] for s in records] == [1, 2]
    assert records[0]["prompt_ids"] == d.prompts[0]
    assert records[0]["generated_ids"] == d.answers[0]
    assert result["identical_to_baseline"] == 2
    assert result["tau_generate"] > 2.0 and result["tau"] > 1.5
    # the summary is exactly what the written accepted lengths add up to
    steps = np.asarray([a for s in records for a in s["accept_lengths"]])
    assert result["tau_generate"] == pytest.approx((steps + 1).mean(), abs=1e-6)
    assert result["accept_rate"] == pytest.approx(
        [(steps >= j).sum() / (steps >= j - 1).sum() for j in range(1, 6)], abs=1e-6)
    assert result["accept_histogram"] == np.bincount(steps, minlength=6).tolist()
    assert result["speedup"] > 0 and result["device"] == "cpu"


