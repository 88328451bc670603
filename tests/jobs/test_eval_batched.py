"""`eval --sweep`'s choice of the fastest drafting shape, on constructed numbers."""

from __future__ import annotations

from eagle3kit.decode.speculative import DecodeConfig
from eagle3kit.hub.card import EvalResult
from eagle3kit.hub.sections import sweep_winner
from eagle3kit.jobs.eval_batched import best_per_batch, parse_sweep


def _point(batch, shape, speedup):
    steps, topk, nodes = (int(shape), 1, int(shape) + 1) if "/" not in shape else map(
        int, shape.split("/"))
    return {"batch": batch, "shape": shape, "steps": steps, "topk": topk,
            "draft_tokens": nodes, "speedup": speedup}


GRID = [_point(1, "3", 1.9), _point(1, "5/4/8", 2.4), _point(1, "7", 2.1),
        _point(8, "3", 1.6), _point(8, "5/4/8", 1.5), _point(8, "5", 1.6),
        _point(64, "3", 0.9), _point(64, "7", 0.7)]


def test_best_per_batch_is_the_highest_speedup_first_on_ties():
    best = best_per_batch(GRID)
    assert {b: p["shape"] for b, p in best.items()} == {"1": "5/4/8", "8": "3", "64": "3"}
    chains = best_per_batch([p for p in GRID if p["topk"] == 1])
    assert chains["1"]["shape"] == "7"


def test_the_card_serves_the_winner_at_the_smallest_batch_and_the_best_chain_for_vllm():
    e = EvalResult(mode="generate", acc=[0.5], device="NVIDIA H100", best=best_per_batch(GRID),
                   best_chain=best_per_batch([p for p in GRID if p["topk"] == 1]))
    best, chain, device, batch = sweep_winner([EvalResult(acc=[0.5]), e])
    assert (best["shape"], chain["shape"], device, batch) == ("5/4/8", "7", "NVIDIA H100", 1)
    assert sweep_winner([EvalResult(acc=[0.5])]) is None


def test_the_default_grid_is_chains_and_trees_sglang_accepts():
    shapes = [(d.steps, d.topk, d.nodes) for d in parse_sweep(None, DecodeConfig())]
    assert shapes == [(3, 1, 4), (5, 1, 6), (7, 1, 8), (3, 4, 8), (5, 4, 8), (5, 8, 16)]
    # trees sample too (tree speculative sampling): the same grid at temperature > 0
    sampled = parse_sweep(None, DecodeConfig(temperature=0.7))
    assert [(d.steps, d.topk, d.nodes, d.temperature) for d in sampled] == [
        (*s, 0.7) for s in shapes]
