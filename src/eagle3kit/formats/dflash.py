"""DFlash drafts (core/dflash.py) in the two engine formats that serve them.

speculators (vLLM): what speculators 0.9.0's `DFlashDraftModel.save_pretrained` writes,

    config.json   speculators_model_type "dflash", transformer_layer_config (the decoder's
                  fields, num_hidden_layers = the draft's layers), block_size,
                  aux_hidden_state_layer_ids (HF hidden_states indices, vLLM's capture),
                  mask_token_id, sample_from_anchor false (the anchor is the verified bonus
                  token, block_size - 1 proposed), draft_vocab_size
    tensors       fc, hidden_norm, layers.{i}.*, norm; lm_head, d2t and t2d only for a
                  reduced draft vocabulary (over the full one the head is the verifier's)

SGLang 0.5.23 (`srt/models/dflash.py`, the format of SpecForge's and z-lab's drafts): a
Qwen3-style config with architectures ["DFlashDraftModel"], block_size, num_target_layers and
dflash_config {target_layer_ids (the output of layer i: HF index - 1), mask_token_id}; the same
tensors without any head (SGLang projects through the target's), so the full vocabulary only.

A published draft of another block method (DFlash2's selector or convolutions, Domino's
projector, DSpark, attention sinks) is refused, never read as DFlash.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from eagle3kit.core.config import TargetConfig
from eagle3kit.errors import InputError, MismatchError
from eagle3kit.formats import common
from eagle3kit.io import safetensors as st
from eagle3kit.io.draft_io import Draft

MODEL_TYPE = "dflash"
ARCHITECTURE = "DFlashDraftModel"
# dflash_config keys of block methods eagle3kit does not run
_OTHER_METHODS = ("conv_kernel_size", "selector_rank", "projector_type", "attention_sink_bias",
                  "markov_rank")
IGNORED = ("embed_tokens.weight", "verifier_lm_head.weight", "verifier_norm.weight")


def is_sglang_dflash(config_dict: dict[str, Any]) -> bool:
    return "speculators_model_type" not in config_dict and (
        "dflash_config" in config_dict
        or any("DFlash" in a for a in config_dict.get("architectures") or ()))


def _tensors(draft: Draft, fmt: str, dtype: str) -> dict[str, Any]:
    table = common.export_keys(fmt, draft.config)
    tensors = common.to_tensors(draft, table, dtype)
    if draft.config.draft_vocab_size == draft.config.vocab_size:
        # the full vocabulary: the engines project through the target's own head and take its
        # ids as they are (a permuted draft vocab only reorders the frozen head's columns)
        del tensors["d2t"], tensors["t2d"]
    return tensors


def _checked(draft: Draft, fmt: str, min_layer_id: int) -> TargetConfig:
    common.export_keys(fmt, draft.config)  # a format that cannot express the draft: first
    target = common.check_exportable(draft, min_layer_id)
    if not 0 <= draft.config.mask_token_id < target.vocab_size:
        raise MismatchError(f"mask token id {draft.config.mask_token_id} is outside the "
                            f"target's vocabulary of {target.vocab_size}")
    return target


def speculators_config(draft: Draft, target: TargetConfig, dtype: str) -> dict[str, Any]:
    cfg = draft.config
    if not draft.target_name:
        raise MismatchError("the speculators format names the verifier (target) model; pass "
                            "--target-name ORG/MODEL")
    return {
        "architectures": [ARCHITECTURE],
        "speculators_model_type": MODEL_TYPE,
        "transformer_layer_config": common.llama_fields(draft, target, dtype),
        "draft_vocab_size": cfg.draft_vocab_size,
        "block_size": cfg.block_size,
        "aux_hidden_state_layer_ids": list(cfg.aux_layer_ids),
        "mask_token_id": cfg.mask_token_id,
        "sample_from_anchor": False,
        "sliding_window_non_causal": False,
        "target_hidden_size": cfg.target_hidden_size,
        "tie_word_embeddings": False,
        # the anchor is the verified bonus token: block_size - 1 proposed
        "speculators_config": common.speculators_block(MODEL_TYPE, draft, target,
                                                       cfg.block_size - 1),
        "torch_dtype": dtype,
        "dtype": dtype,
    }


def sglang_config(draft: Draft, target: TargetConfig, dtype: str) -> dict[str, Any]:
    cfg = draft.config
    fields = common.llama_fields(draft, target, dtype)
    fields.update({
        "architectures": [ARCHITECTURE],
        "model_type": "qwen3",
        "block_size": cfg.block_size,
        "num_target_layers": target.num_layers,
        "dflash_config": {"target_layer_ids": [i - 1 for i in cfg.aux_layer_ids],
                          "mask_token_id": cfg.mask_token_id, "block_size": cfg.block_size},
    })
    return fields


def write(fmt: str, directory: Path, draft: Draft, dtype: str) -> dict[str, Any]:
    """config.json and model.safetensors of `draft` in `fmt` ("speculators" or "sglang")."""
    if fmt == "speculators":
        fields = speculators_config(draft, _checked(draft, fmt, 0), dtype)
    else:
        fields = sglang_config(draft, _checked(draft, fmt, 1), dtype)
    st.save(directory / common.WEIGHTS, _tensors(draft, fmt, dtype), {"format": "pt"})
    return common.write_config(directory, fields)


def read(fmt: str, directory: Path, config_dict: dict[str, Any], tensors: dict[str, Any],
         target: dict[str, Any]):
    """(DraftConfig, DFlashWeights, VocabMap) of a DFlash checkpoint in `fmt`."""
    where = directory / "config.json"
    if fmt == "speculators":
        layer = config_dict.get("transformer_layer_config")
        ids = config_dict.get("aux_hidden_state_layer_ids")
        extra = config_dict
        if config_dict.get("sample_from_anchor"):
            raise InputError("sample_from_anchor: true (the anchor slot proposes too, as "
                             "DSpark trains it) is not DFlash as eagle3kit runs it", path=where)
    else:
        layer, extra = config_dict, config_dict.get("dflash_config") or {}
        if config_dict.get("architectures", [ARCHITECTURE]) != [ARCHITECTURE] or any(
                extra.get(k) for k in _OTHER_METHODS):
            raise InputError(f"a {config_dict.get('architectures')} draft with "
                             f"{sorted(k for k in _OTHER_METHODS if extra.get(k))} is not "
                             "DFlash; eagle3kit reads DFlashDraftModel only", path=where)
        raw = extra.get("target_layer_ids")
        ids = None if raw is None else [int(i) + 1 for i in raw]
    if not isinstance(layer, dict):
        raise InputError("the decoder's fields are missing", path=where)
    if layer.get("layer_types") and set(layer["layer_types"]) != {"full_attention"}:
        raise InputError(f"layer_types {layer['layer_types']}: sliding-window DFlash layers "
                         "are not supported", path=where)
    ids = tuple(sorted(int(i) for i in ids)) if ids else common.default_aux_ids(target, where)
    block = extra.get("block_size", config_dict.get("block_size"))
    mask = extra.get("mask_token_id", config_dict.get("mask_token_id"))
    if block is None or mask is None:
        raise InputError("block_size and mask_token_id are required", path=where)
    cfg = common.read_llama_fields(
        layer, where, draft_vocab_size=config_dict.get("draft_vocab_size"),
        target_hidden_size=common.fc_width(config_dict, tensors, len(ids)), aux_layer_ids=ids,
        norm_before_residual=False, method=MODEL_TYPE, block_size=int(block),
        mask_token_id=int(mask))
    ignored = IGNORED + (("lm_head.weight",) if cfg.draft_vocab_size == cfg.vocab_size else ())
    weights, vocab = common.read_weights(tensors, common.export_keys("speculators", cfg),
                                         ignored, cfg, directory)
    return cfg, weights, vocab
