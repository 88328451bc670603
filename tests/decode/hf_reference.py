"""References from transformers for the decoding tests: greedy `generate`'s tokens checked in
one forward, and a check that sampled streams draw fresh randomness at every token.

`repeat_zscores`: in a correctly sampled stream, token i given everything before it is a
draw from p_i = softmax(logits_i / T), so the indicator "token i equals token i-l" has
conditional mean p_i(token i-l). Summed over streams and positions, the count of such
repeats minus the sum of those probabilities is a sum of martingale differences: its
z-score is about N(0, 1) whatever the model. A sampler that reuses randomness (the same key
for two tokens, or for two verify steps) draws the same uniforms again; on a model whose
distributions are nearly flat that gives the same token again, l positions later, far more
often than p_i says.
"""

from __future__ import annotations

import math

import torch


def greedy_divergence(model, prompt: list[int], tokens: list[int]) -> int | None:
    """The first index at which `tokens` leaves transformers' greedy continuation of
    `prompt`, or None. Each token must be the argmax after the ones before it, which one
    forward over prompt + tokens checks for all of them (`generate` would run one per token):
    tokens that pass are, by induction, exactly what greedy `generate` gives."""
    with torch.no_grad():  # the logits from the prompt's last position on, not the prompt's
        logits = model(torch.tensor([prompt + tokens]), logits_to_keep=len(tokens) + 1).logits[0]
    best = logits[:len(tokens)].argmax(-1).tolist()
    return next((i for i, (a, b) in enumerate(zip(tokens, best, strict=True)) if a != b),
                None)


def repeat_zscores(model, prompts: list[list[int]], streams: list[list[int]],
                   temperature: float, lags: range) -> dict[int, float]:
    """{lag l: z-score of the repeats token i == token i-l over the generated tokens of all
    streams (stream j generated after prompts[j]), against the model's probabilities}."""
    observed = {lag: 0.0 for lag in lags}
    expected = {lag: 0.0 for lag in lags}
    variance = {lag: 0.0 for lag in lags}
    for prompt, stream in zip(prompts, streams, strict=True):
        with torch.no_grad():
            logits = model(torch.tensor([prompt + stream])).logits[0].double()
        # p[i] is the distribution of stream[i]: the logits at the position before it
        p = torch.softmax(logits[len(prompt) - 1: len(prompt) - 1 + len(stream)] / temperature,
                          dim=-1)
        for lag in lags:
            for i in range(lag, len(stream)):
                q = float(p[i, stream[i - lag]])
                observed[lag] += stream[i] == stream[i - lag]
                expected[lag] += q
                variance[lag] += q * (1 - q)
    return {lag: (observed[lag] - expected[lag]) / math.sqrt(variance[lag]) for lag in lags}
