"""The one engine (decode/engine.py) set up as the decode tests use it: speculative or plain,
any number of rows (one row is batch-1 decoding)."""

from __future__ import annotations

from eagle3kit.decode.engine import Engine, EngineConfig, Request, Sampling
from eagle3kit.decode.speculative import DecodeConfig, Speculation


def slots_for(prompt_len: int, dec: DecodeConfig) -> int:
    """Slots a row needs for a prompt, its answer and one verify step, in whole 128s."""
    return -(-(prompt_len + dec.max_new_tokens + dec.verified) // 128) * 128


def speculative(tcfg, target_w, dcfg, draft_w, vocab, dec: DecodeConfig, stops, mesh, *,
                rows: int = 1, max_context: int = 256, sync_every: int = 8,
                prefill_chunk: int = 512, check_every: int = 1, attention: str = "xla"
                ) -> Engine:
    return Engine(tcfg, target_w, mesh, list(stops),
                  EngineConfig(rows=rows, max_context=max_context, sync_every=sync_every,
                               check_every=check_every, prefill_chunk=prefill_chunk,
                               sampling=Sampling(dec.temperature), attention=attention),
                  Speculation(dcfg, draft_w, vocab, dec))


def plain(tcfg, target_w, dec: DecodeConfig, stops, mesh, *, rows: int = 1,
          max_context: int = 256, sync_every: int = 32) -> Engine:
    return Engine(tcfg, target_w, mesh, list(stops),
                  EngineConfig(rows=rows, max_context=max_context, sync_every=sync_every,
                               sampling=Sampling(dec.temperature)))


def one(engine: Engine, prompt, limit: int, seed: int = 0):
    """One request through the engine -> its Completion (tokens, accept_lengths)."""
    return engine.generate([Request(0, list(prompt), limit, seed)])[0]
