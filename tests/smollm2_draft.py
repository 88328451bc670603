"""A small trained EAGLE3 draft for the real SmolLM2-135M-Instruct, built once per test session.

Data: the target's own greedy answers to the first MT-bench questions (self-distillation, the
way SpecForge regenerates data) and a real ShareGPT conversation, rendered with the real chat
template. The answers come from a plain host loop over `core.row_cache.forward_rows` on one
cache row, one token per call: an implementation of greedy decoding independent of
`eagle3kit.decode`, and the reference the decoding engine is checked against.

Training: the TTT loss the trainer uses (`core.ttt.rollout`), with AdamW. The target is
frozen, so its signals are computed once instead of every step as `Trainer` does: same loss,
a fraction of the CPU time. Trained on the answers it is later asked to reproduce, the draft
gets long runs of tokens accepted, which exercises every acceptance length of the decoder.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from eagle3kit.core import target as target_model
from eagle3kit.core import ttt
from eagle3kit.core.config import DraftConfig, TargetConfig
from eagle3kit.core.draft import DraftWeights
from eagle3kit.core.sharding import make_mesh
from eagle3kit.core.vocab import VocabMap
from eagle3kit.core.vocab_arrays import VocabArrays
from eagle3kit.data.chat import render
from eagle3kit.data.fingerprint import tokenizer_fingerprint
from eagle3kit.data.packing import TokenDocs, pack_epoch
from eagle3kit.data.prompts import load_prompts, prompt_ids
from eagle3kit.data.records import TokenRecord
from eagle3kit.decode import row_cache
from eagle3kit.decode.conversations import Dialogue
from eagle3kit.io.draft_io import Draft, load_draft, save_draft
from eagle3kit.io.hf import TargetCheckpoint, load_target, resolve_target
from tests import assets

QUESTIONS = 2  # MT-bench first turns answered by the reference loop
ANSWER_TOKENS = 40
DRAFT_VOCAB = 1024
TRAIN_STEPS = 24
SHAREGPT_TOKENS = 44  # with the two answers, one packed row of SEQ_LEN
TTT_STEPS = 3
SEQ_LEN = 256
EOS = 2  # <|im_end|>


@dataclasses.dataclass
class Smollm2:
    """The real target on one CPU device, fp32, with its tokenizer."""

    ckpt: TargetCheckpoint
    cfg: TargetConfig
    weights: Any
    mesh: Any
    tokenizer: Any
    key: str  # tokenizer fingerprint key


@functools.lru_cache(maxsize=1)
def smollm2() -> Smollm2:
    ckpt = resolve_target(assets.smollm2_gguf())
    mesh = make_mesh("data=1,tensor=1", jax.devices()[:1])
    tok = assets.smollm2_tokenizer()
    # per-layer arrays (the engine's layout; forward and the TTT signals take them too)
    weights = target_model.unstack_in_place(load_target(ckpt, mesh, jnp.float32), ckpt.config)
    return Smollm2(ckpt, ckpt.config, weights, mesh, tok,
                   tokenizer_fingerprint(tok, str(assets.smollm2_gguf())).key)


def greedy_reference(t: Smollm2, prompts: list[list[int]], max_new: int) -> list[list[int]]:
    """Plain greedy decoding, every prompt in a cache row of its own at its own positions, one
    host round trip per token (each answer until <|im_end|> or max_new)."""
    cache = row_cache.RowCache.zeros(t.cfg, len(prompts), 256, jnp.float32)
    step = _step_fn(t.cfg)
    padded = np.zeros((len(prompts), 128), np.int32)
    for row, prompt in zip(padded, prompts, strict=True):
        row[: len(prompt)] = prompt
    logits, cache = step(t.weights, jnp.asarray(padded), jnp.zeros((len(prompts), 1), jnp.int32),
                         cache, True)
    outs = [[int(np.argmax(logits[i, len(p) - 1]))] for i, p in enumerate(prompts)]
    for n in range(1, max_new):
        live = [len(o) == n and o[-1] != EOS for o in outs]
        if not any(live):
            break
        logits, cache = step(t.weights, jnp.asarray([[o[-1]] for o in outs], jnp.int32),
                             jnp.asarray([[len(p) + n - 1] for p in prompts], jnp.int32),
                             cache, False)
        for o, more, row in zip(outs, live, np.asarray(logits[:, 0]), strict=True):
            if more:
                o.append(int(np.argmax(row)))
    return outs


@functools.cache
def _step_fn(cfg: TargetConfig):
    def step(w, tokens, start_B, cache, prefill):  # row b's tokens from position start_B[b]
        positions = start_B + jnp.arange(tokens.shape[1])[None]
        out, cache = row_cache.forward_rows(w, cfg, tokens, positions, cache,
                                               prefill=prefill)
        return target_model.logits(w, out.hidden_BxTxD), cache
    return jax.jit(step, static_argnums=4)


@dataclasses.dataclass
class TrainedDraft:
    path: Path  # eagle3kit-format draft directory
    draft: Draft
    prompts: list[list[int]]  # chat-templated MT-bench first turns
    answers: list[list[int]]  # the target's greedy answers to them (the reference)


def trained_draft(directory: Path) -> TrainedDraft:
    """The draft and its reference answers, built into `directory` once and read from there
    after (the test processes of one session share it: conftest's fixture holds a lock)."""
    path, reference = directory / "draft", directory / "reference.json"
    if reference.exists():
        saved = json.loads(reference.read_text())
        return TrainedDraft(path, load_draft(path), saved["prompts"], saved["answers"])
    made = _trained_draft(path)
    reference.write_text(json.dumps({"prompts": made.prompts, "answers": made.answers}))
    return made


def _trained_draft(path: Path) -> TrainedDraft:
    t = smollm2()
    conversations = load_prompts("mt-bench", QUESTIONS).conversations
    prompts = [prompt_ids(t.tokenizer, Dialogue.from_user_turns(c.turns, c.system).prompt())
               for c in conversations]
    answers = greedy_reference(t, prompts, ANSWER_TOKENS)
    records = [TokenRecord(f"mt-bench-{i}", p + a, [0] * len(p) + [1] * len(a), t.key)
               for i, (p, a) in enumerate(zip(prompts, answers, strict=True))]
    records.append(_sharegpt_snippet(t))
    counts = np.zeros(t.cfg.vocab_size, np.int64)
    for r in records:
        np.add.at(counts, np.asarray(r.input_ids)[np.asarray(r.loss_mask, bool)], 1)
    vocab, _ = VocabMap.from_counts(counts, DRAFT_VOCAB)
    cfg = dataclasses.replace(DraftConfig.for_target(t.cfg, DRAFT_VOCAB), intermediate_size=384)
    weights = _train(t, cfg, vocab, TokenDocs.from_records(records, SEQ_LEN))
    fingerprint = tokenizer_fingerprint(t.tokenizer, str(assets.smollm2_gguf()))
    d = Draft(cfg, weights, vocab, t.cfg.name, t.ckpt.hf_config,
              {"tokenizer": fingerprint.to_json()}, {"steps": TRAIN_STEPS})
    save_draft(path, d)
    return TrainedDraft(path, d, prompts, answers)


def _sharegpt_snippet(t: Smollm2) -> TokenRecord:
    """The start of the first real ShareGPT conversation whose answer begins early enough."""
    for chat in assets.sharegpt_chats(40):
        ids, mask = render(t.tokenizer, chat.messages)
        if sum(mask[:SHAREGPT_TOKENS]) >= SHAREGPT_TOKENS // 3:
            return TokenRecord(chat.id, ids[:SHAREGPT_TOKENS], mask[:SHAREGPT_TOKENS], t.key)
    raise AssertionError("no short ShareGPT exchange among the first 40 conversations")


def _train(t: Smollm2, cfg: DraftConfig, vocab: VocabMap, docs: TokenDocs) -> DraftWeights:
    packed = pack_epoch(docs, SEQ_LEN, seed=0, epoch=0)
    batch = ttt.Batch(**{k: jnp.asarray(v)
                         for k, v in packed.batch(0, len(packed.rows)).items()})
    va = VocabArrays.from_map(vocab)
    sig = jax.jit(lambda w, b: ttt.target_signals(w, t.cfg, cfg, va, b))(t.weights, batch)
    tx = optax.chain(optax.clip_by_global_norm(0.5), optax.adamw(3e-3, b1=0.9, b2=0.95))
    w = assets.train_draft(cfg, sig, batch, va, TTT_STEPS, tx, TRAIN_STEPS)
    return jax.tree.map(np.asarray, w)
