"""What the SGLang and speculators formats share: the key table, the Llama decoder fields, the
target lookup, the provenance sidecar and the checks made before anything is written.

Both engines load the same thirteen trainable tensors in the Hugging Face layout (linear
weights [out, in]) plus `d2t` (int64 offsets [Vd]) and `t2d` (bool [V]); only the prefix of the
decoder layer differs (`midlayer.` for SGLang/EAGLE/SpecForge, `layers.0.` for speculators).
eagle3kit stores linear weights (in, out) with heads split out (core/draft.py); a `Key` says
how many leading axes of the eagle3kit array are the linear's input, which is all the layout
conversion needs: HF = reshape(prod(in), prod(out)).T.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
from pathlib import Path
from typing import Any

import numpy as np

from eagle3kit import __version__
from eagle3kit.core import arches
from eagle3kit.core.arches import Key
from eagle3kit.core.config import DraftConfig, RopeConfig, TargetConfig
from eagle3kit.core.draft import arrays
from eagle3kit.core.vocab import VocabMap
from eagle3kit.errors import InputError, MismatchError
from eagle3kit.formats import registry
from eagle3kit.io.draft_io import Draft
from eagle3kit.io.dtypes import DTYPES, dtype_name

log = logging.getLogger("eagle3kit.formats")

# The file engines ignore that carries what `push` needs for the model card and what an
# import needs to rebuild the eagle3kit draft exactly (target config, training record).
SIDECAR = "eagle3kit.json"
SIDECAR_FORMAT = "eagle3kit-export"
WEIGHTS = "model.safetensors"

# ---- the key table ------------------------------------------------------------------------
# What each tensor of an engine format holds is the architecture's to say (its module's
# `export_keys`, core/arches.py); `Key` is defined there.


def method(cfg: DraftConfig) -> Any:
    """The module implementing `cfg`'s method (core/draft.py for EAGLE-3 and 3.1)."""
    return arches.method_module(cfg.method)


def export_keys(fmt: str, cfg: DraftConfig) -> tuple[Key, ...]:
    """The tensors format `fmt` holds for `cfg`; a format the architecture has no mapping for
    is refused."""
    keys = method(cfg).export_keys(fmt, cfg)
    if keys is None:
        fmt_name = registry.get(fmt).display if registry.get(fmt) else fmt
        raise MismatchError(f"the {cfg.arch} draft cannot be written in the {fmt_name} format; "
                            f"choose {registry.spoken(formats_of(cfg))}")
    return keys


def formats_of(cfg: DraftConfig) -> tuple[str, ...]:
    """The registered formats that can express `cfg` (eagle3kit's own always can)."""
    impl = method(cfg)
    return tuple(f for f in registry.names()
                 if f == "eagle3kit" or impl.export_keys(f, cfg) is not None)


def read_method(fmt: str, config: dict[str, Any], where: object) -> dict[str, Any]:
    """The `DraftConfig` fields of the method whose mapping reads `config` in format `fmt`
    (the registered methods asked in turn)."""
    for impl in dict.fromkeys(arches.method_module(a.method) for a in arches.arches()):
        fields = impl.read_flags(fmt, config)
        if fields is not None:
            return fields
    raise InputError(f"not a draft architecture eagle3kit reads in this format (it reads "
                     f"{', '.join(arches.names())})", path=where)


def hf_shape(shape: tuple[int, ...], key: Key) -> tuple[int, ...]:
    """eagle3kit shape (in..., out...) -> HF shape [out, in]."""
    if key.n_in == 0:
        return shape
    return (math.prod(shape[key.n_in:]), math.prod(shape[: key.n_in]))


def to_tensors(draft: Draft, table: tuple[Key, ...], dtype: str) -> dict[str, np.ndarray]:
    """Every engine tensor of `draft`, cast to `dtype`; `d2t` int64 and `t2d` bool as they are."""
    np_dtype = DTYPES[dtype_name(dtype)]
    out: dict[str, np.ndarray] = {}
    for key in table:
        # cast before transposing: the strided copy then moves half the bytes (bf16)
        w = np.asarray(getattr(draft.weights, key.field), np.float32).astype(np_dtype)
        if key.index is not None:
            w = w[key.index]
        if key.n_in:
            w = w.reshape(math.prod(w.shape[: key.n_in]), -1).T
        out[key.name] = np.ascontiguousarray(w)
    out["d2t"] = np.ascontiguousarray(draft.vocab.d2t, np.int64)
    out["t2d"] = np.ascontiguousarray(draft.vocab.t2d, np.bool_)
    return out


def from_tensors(tensors: dict[str, np.ndarray], table: tuple[Key, ...], cfg: DraftConfig,
                 where: object) -> tuple[Any, VocabMap]:
    """Engine tensors -> fp32 weights of `cfg`'s method and the vocab map, checking every
    shape and name."""
    weights_class = method(cfg).Weights
    abstract = weights_class.abstract(cfg)
    values, rows = {}, {}
    for key in table:
        shape = getattr(abstract, key.field).shape
        if key.index is not None:
            shape = shape[1:]
        if key.name not in tensors:
            raise InputError(f"missing tensor {key.name!r}", path=where)
        w = tensors[key.name]
        if tuple(w.shape) != hf_shape(shape, key):
            raise InputError(f"tensor {key.name!r} has shape {tuple(w.shape)}, the config says "
                             f"{hf_shape(shape, key)}", path=where)
        w = np.asarray(w, np.float32)
        # a stacked field's row is a linear too (DFlash's layers.{i}.*): reshaped like one
        w = np.ascontiguousarray(w.T).reshape(shape) if key.n_in else w.copy()
        if key.index is not None:  # rows of a stacked field come in order
            rows.setdefault(key.field, []).append(w)
            continue
        values[key.field] = w
    values.update({field: np.stack(ws) for field, ws in rows.items()})
    if "d2t" not in tensors:
        if cfg.draft_vocab_size != cfg.vocab_size:
            # speculators and vLLM would silently assume the identity here: acceptance collapses
            raise InputError(f"missing tensor 'd2t' but the draft vocab ({cfg.draft_vocab_size})"
                             f" is smaller than the target vocab ({cfg.vocab_size})", path=where)
        vocab = VocabMap.identity(cfg.vocab_size)
    else:
        d2t = np.asarray(tensors["d2t"])
        if d2t.dtype.kind not in "iu":
            raise InputError(f"d2t has dtype {d2t.dtype}; it must hold integer offsets",
                             path=where)
        if "t2d" in tensors:
            t2d = np.asarray(tensors["t2d"]).astype(np.bool_)
        else:  # EAGLE's own checkpoints sometimes ship only d2t
            t2d = np.zeros(cfg.vocab_size, np.bool_)
            ids = np.arange(len(d2t)) + d2t
            t2d[ids[(ids >= 0) & (ids < cfg.vocab_size)]] = True
        if (len(d2t), len(t2d)) != (cfg.draft_vocab_size, cfg.vocab_size):
            raise InputError(f"d2t/t2d have lengths {len(d2t)}/{len(t2d)}, the config says "
                             f"{cfg.draft_vocab_size}/{cfg.vocab_size}", path=where)
        try:
            vocab = VocabMap(d2t.astype(np.int64), t2d)
        except InputError as e:
            raise InputError(str(e), path=where) from None
    return weights_class(**values), vocab


def read_weights(tensors: dict[str, np.ndarray], table: tuple[Key, ...], ignored: tuple[str, ...],
                 cfg: DraftConfig, where: object) -> tuple[Any, VocabMap]:
    """`from_tensors` after refusing tensors that belong to no parameter (an engine would
    silently skip them or fail) and dropping the ones eagle3kit never needs."""
    extra = sorted(set(tensors) - {k.name for k in table} - {"d2t", "t2d", *ignored})
    if extra:
        raise InputError(f"{len(extra)} tensors do not belong to an {cfg.arch} draft in this "
                         f"format, e.g. {extra[0]!r}", path=where)
    if "embed_tokens.weight" in tensors and not any(k.field == "embed" for k in table):
        log.warning("ignoring embed_tokens.weight: eagle3kit embeds tokens with the target's "
                    "own embedding, as SGLang does (vLLM would have used this copy)")
    return from_tensors(tensors, table, cfg, where)


def fc_width(config_dict: dict[str, Any], tensors: dict[str, np.ndarray],
             n_aux: int) -> int | None:
    """The target hidden size fc reads: the config's, else fc.weight's width / n_aux."""
    fc = tensors.get("fc.weight")
    return config_dict.get("target_hidden_size") or (
        fc.shape[1] // n_aux if fc is not None else None)


def speculators_block(algorithm: str, draft: Draft, target: TargetConfig,
                      speculative_tokens: int) -> dict[str, Any]:
    """The `speculators_config` of a speculators export: the algorithm, greedy proposals of
    `speculative_tokens`, and the verifier vLLM loads."""
    return {
        "algorithm": algorithm,
        "proposal_methods": [{"proposal_type": "greedy",
                              "speculative_tokens": speculative_tokens,
                              "verifier_accept_k": 1, "accept_tolerance": 0.0}],
        "default_proposal_method": "greedy",
        "verifier": {"name_or_path": draft.target_name,
                     "architectures": list(target.architectures)},
    }


# ---- the Llama decoder fields -------------------------------------------------------------


def rope_fields(cfg: DraftConfig) -> dict[str, Any]:
    """`rope_theta`/`rope_scaling` (transformers 4.x, SGLang, older vLLM) and the equivalent
    `rope_parameters` (transformers 5.x, newer vLLM): every reader finds the same rope."""
    fields = cfg.rope.to_hf()
    fields["rope_parameters"] = {"rope_type": cfg.rope.kind, "rope_theta": cfg.rope.theta,
                                 **(fields["rope_scaling"] or {})}
    return fields


def llama_fields(draft: Draft, target: TargetConfig, dtype: str) -> dict[str, Any]:
    """The one-layer Llama decoder both engines build, every field written explicitly."""
    cfg = draft.config
    fields: dict[str, Any] = {
        "model_type": "llama",
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "num_hidden_layers": cfg.num_layers,
        "hidden_act": "silu",
        "rms_norm_eps": cfg.rms_norm_eps,
        "vocab_size": cfg.vocab_size,
        # the target's: a draft config saying 2048 degrades long contexts (SpecForge#271)
        "max_position_embeddings": target.max_position_embeddings,
        **rope_fields(cfg),
        "attention_bias": False,
        "mlp_bias": False,
        # SGLang makes lm_head the embedding when this is true
        "tie_word_embeddings": False,
        "torch_dtype": dtype,
        "dtype": dtype,
    }
    for k in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if draft.target_config.get(k) is not None:
            fields[k] = draft.target_config[k]
    return fields


def read_llama_fields(d: dict[str, Any], where: object, *, vocab_size: int | None = None,
                      draft_vocab_size: int | None = None, target_hidden_size: int | None = None,
                      aux_layer_ids: tuple[int, ...], norm_before_residual: bool,
                      **method_fields: Any) -> DraftConfig:
    """DraftConfig from an engine's Llama fields and the method's own (`read_method`);
    refuses what the eagle3kit head can't run."""
    num_layers = int(d.get("num_hidden_layers", 1))
    if num_layers != 1 and not getattr(arches.method_module(
            method_fields.get("method", "eagle3")), "MULTI_LAYER", False):
        raise InputError(f"num_hidden_layers={d['num_hidden_layers']}: only one-layer EAGLE3 "
                         "drafts are supported", path=where)
    for flag in ("attention_bias", "mlp_bias", "bias"):
        if d.get(flag):
            raise InputError(f"{flag}: true is not supported (the draft head has no biases)",
                             path=where)
    if d.get("hidden_act", "silu") != "silu":
        raise InputError(f"hidden_act={d['hidden_act']!r} is not supported (silu only)",
                         path=where)
    try:
        hidden, heads = int(d["hidden_size"]), int(d["num_attention_heads"])
        vocab = int(vocab_size if vocab_size is not None else d["vocab_size"])
        return DraftConfig(
            hidden_size=hidden,
            intermediate_size=int(d["intermediate_size"]),
            num_heads=heads,
            num_kv_heads=int(d.get("num_key_value_heads") or heads),
            head_dim=int(d.get("head_dim") or hidden // heads),
            vocab_size=vocab,
            draft_vocab_size=int(draft_vocab_size or d.get("draft_vocab_size") or vocab),
            target_hidden_size=int(target_hidden_size or hidden),
            aux_layer_ids=tuple(aux_layer_ids),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope=RopeConfig.from_hf(d, where),
            max_position_embeddings=int(d.get("max_position_embeddings", 8192)),
            norm_before_residual=norm_before_residual,
            num_layers=num_layers,
            **method_fields,
        )
    except KeyError as e:
        raise InputError(f"config is missing the field {e.args[0]!r}", path=where) from None


# ---- the target ---------------------------------------------------------------------------


def default_aux_ids(target: dict[str, Any], where: object) -> tuple[int, ...]:
    try:
        return TargetConfig.from_hf_config(target, source=where).default_aux_layer_ids()
    except InputError as e:
        raise InputError(f"cannot read the target config ({e})", path=where) from None


# ---- config.json ----------------------------------------------------------------------------


def float32_shortest(value: Any) -> Any:
    """`value` with every float that is exactly a float32 written as that float32's shortest
    decimal: a GGUF stores rms_norm_eps, rope_theta and the like as float32, so a target read
    from one says 9.999999974752427e-07 where its own config says 1e-06, and an engine's
    config should read as the model's does. The float32 is unchanged (1e-06 rounds to it);
    floats that are not float32 values (a float64 0.1) stay as they are."""
    if isinstance(value, dict):
        return {k: float32_shortest(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(float32_shortest(v) for v in value)
    if isinstance(value, float) and math.isfinite(value):
        single = np.float32(value)
        if float(single) == value:
            return float(str(single))
    return value


def write_config(directory: Path, fields: dict[str, Any]) -> dict[str, Any]:
    """Writes an engine's config.json (floats as `float32_shortest` gives them); returns what
    it wrote."""
    fields = float32_shortest(fields)
    (directory / "config.json").write_text(json.dumps(fields, indent=2) + "\n")
    return fields


# ---- the sidecar ----------------------------------------------------------------------------


def write_sidecar(directory: Path, draft: Draft, engine_format: str, dtype: str,
                  extra: dict[str, Any]) -> None:
    meta = {
        "format": SIDECAR_FORMAT, "version": 1, "engine_format": engine_format,
        "dtype": dtype, "eagle3kit_version": __version__, "draft": draft.config.to_dict(),
        "target": {"name": draft.target_name, "config": draft.target_config},
        "fingerprints": draft.fingerprints, "training": draft.training, **extra,
    }
    (directory / SIDECAR).write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")


def read_sidecar(directory: str | os.PathLike) -> dict[str, Any] | None:
    """The export's provenance, or None when the directory was not written by eagle3kit."""
    p = Path(directory) / SIDECAR
    if not p.is_file():
        return None
    try:
        meta = json.loads(p.read_text())
    except json.JSONDecodeError as e:
        raise InputError(f"invalid JSON ({e})", path=p) from None
    if meta.get("format") != SIDECAR_FORMAT:
        raise InputError(f"unknown format {meta.get('format')!r}", path=p)
    return meta


def draft_digest(draft: Draft, via: str | None = None) -> str:
    """16 hex digits naming a draft's weights and vocabulary whatever format holds it: the
    weights in layer order (`in_layer_order`), rounded to bfloat16 (an fp32 training output
    and its bf16 export agree), after a round trip through `via` (an export's dtype) when
    given; and the vocabulary's target ids. `eval --json` records it, an export's sidecar
    records its source's and its own, and `push` compares them."""
    import hashlib

    draft = in_layer_order(draft)
    h = hashlib.sha256(np.asarray(draft.vocab.used_ids, np.int64).tobytes())
    for name, w in sorted(arrays(draft.weights).items()):
        x = np.asarray(w, np.float32)
        if via is not None:
            x = x.astype(DTYPES[via]).astype(np.float32)
        h.update(name.encode() + x.astype(DTYPES["bfloat16"]).tobytes())
    return h.hexdigest()[:16]


def in_layer_order(draft: Draft) -> Draft:
    """The same draft with its capture layers ascending and fc's input blocks permuted to
    match: engines concatenate the captured states in layer order, whatever order the config
    lists them in."""
    ids = draft.config.aux_layer_ids
    if list(ids) == sorted(ids) or len(set(ids)) != len(ids):
        return draft
    order = np.argsort(ids)
    fc = np.asarray(draft.weights.fc)
    blocks = fc.reshape(len(ids), draft.config.target_hidden_size, -1)[order].reshape(fc.shape)
    log.warning("capture layers %s written in layer order %s (fc's input blocks permuted to "
                "match), the order engines concatenate them in", list(ids), sorted(ids))
    return dataclasses.replace(
        draft, config=dataclasses.replace(draft.config, aux_layer_ids=tuple(sorted(ids))),
        weights=dataclasses.replace(draft.weights, fc=blocks))


# ---- checks before writing ----------------------------------------------------------------


def check_exportable(draft: Draft, min_layer_id: int) -> TargetConfig:
    """Everything an engine would check, and what it would load but run wrong.

    `min_layer_id` is the smallest HF hidden_states index the engine can capture (SGLang: 1,
    since its ids are "output of layer id"; vLLM: 0). Returns the target's config.
    """
    cfg = draft.config
    if not draft.target_config:
        raise MismatchError("the draft's target cannot be determined (no target config "
                            "recorded); pass --target MODEL")
    try:
        target = TargetConfig.from_hf_config(draft.target_config, name=draft.target_name)
    except InputError as e:
        raise MismatchError(f"the recorded target config is unusable: {e}") from None
    n = target.num_layers
    if len(set(cfg.aux_layer_ids)) != len(cfg.aux_layer_ids):
        raise MismatchError(f"capture layers {list(cfg.aux_layer_ids)} repeat a layer: SGLang "
                            "and vLLM capture each layer once, so fc would get fewer states "
                            "than it reads; train with distinct --aux-layers")
    if len(cfg.aux_layer_ids) != 3:
        raise MismatchError(f"the draft reads {len(cfg.aux_layer_ids)} target layers; SGLang "
                            "and vLLM feed exactly 3 to an EAGLE3 head")
    bad = [i for i in cfg.aux_layer_ids if not min_layer_id <= i < n]
    if bad:
        raise MismatchError(f"aux layer ids {list(cfg.aux_layer_ids)} (HF hidden_states "
                            f"indices) do not fit the {n}-layer target {target.name!r}: "
                            f"{bad} outside {min_layer_id}..{n - 1}")
    if cfg.vocab_size != target.vocab_size or draft.vocab.target_size != target.vocab_size:
        raise MismatchError(f"vocab sizes disagree: draft config {cfg.vocab_size}, t2d "
                            f"{draft.vocab.target_size}, target {target.vocab_size}")
    if draft.vocab.draft_size != cfg.draft_vocab_size:
        raise MismatchError(f"d2t has {draft.vocab.draft_size} entries but the draft vocab is "
                            f"{cfg.draft_vocab_size}")
    if cfg.target_hidden_size != target.hidden_size:
        raise MismatchError(f"fc reads 3 x {cfg.target_hidden_size} but the target's hidden "
                            f"size is {target.hidden_size}")
    if cfg.hidden_size != target.hidden_size:
        # the engines embed tokens with the target's embedding, width hidden_size
        raise MismatchError(f"draft hidden size {cfg.hidden_size} differs from the target's "
                            f"{target.hidden_size}; the target's embeddings would not fit")
    for name, info in arrays(method(cfg).Weights.abstract(cfg)).items():
        w = getattr(draft.weights, name)
        if w is None or np.shape(w) != info.shape:
            raise MismatchError(f"weight {name} has shape {np.shape(w) if w is not None else None}, "
                                f"the config says {info.shape}")
        if not np.isfinite(w).all():
            raise MismatchError(f"weight {name} has non-finite values; refusing to export a "
                                "draft that would produce NaN logits")
    if cfg.rope != target.rope:
        log.warning("the draft's rope (%s) differs from the target's (%s); writing the draft's "
                    "own, which is what it was trained with", cfg.rope, target.rope)
    return target
