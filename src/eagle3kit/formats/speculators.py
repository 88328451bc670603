"""The speculators format, as vLLM (`configs/speculators/algos.py`, `llama_eagle3.py`) and the
speculators library load it.

    config.json        speculators_model_type "eagle3": transformer_layer_config (a full
                       one-layer Llama config, vocab_size = target vocab), draft_vocab_size,
                       norm_before_residual, target_hidden_size, eagle_aux_hidden_state_layer_ids
                       (HF hidden_states indices, the convention eagle3kit uses), and
                       speculators_config (greedy proposal, verifier name and architectures)
    model.safetensors  fc.weight, layers.0.*, norm.weight, lm_head.weight, d2t, t2d

Every field vLLM or speculators would otherwise default is written: vLLM assumes
`norm_before_residual: true` when the key is missing (EAGLE3 and SGLang mean false), and
speculators reads a `transformer_layer_config` without `model_type` as Qwen3. The capture
layers are always written: the speculators library otherwise resolves them by fetching the
verifier's config.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from eagle3kit.core import arches
from eagle3kit.core.config import DraftConfig, TargetConfig
from eagle3kit.errors import InputError, MismatchError
from eagle3kit.formats import common, dflash, engine
from eagle3kit.formats.registry import ExportOptions, Serving
from eagle3kit.io import safetensors as st
from eagle3kit.io.draft_io import Draft

LAYER = "layers.0."
ARCHITECTURE = "Eagle3Speculator"
MODEL_TYPE = "eagle3"
# present in checkpoints written by the speculators library; eagle3kit never needs them
IGNORED = ("embed_tokens.weight", "verifier_lm_head.weight", "verifier_norm.weight")
EXPECTS = "speculators_model_type (speculators)"


def config(draft: Draft, target: TargetConfig, dtype: str,
           speculative_tokens: int) -> dict[str, Any]:
    """config.json exactly as vLLM's speculators path reads it."""
    cfg = draft.config
    if not draft.target_name:
        raise MismatchError("the speculators format names the verifier (target) model; pass "
                            "--target-name ORG/MODEL")
    if speculative_tokens < 1:
        raise InputError(f"--speculative-tokens must be >= 1 (got {speculative_tokens})")
    own = common.method(cfg).export_fields("speculators", cfg)
    fields = {
        "architectures": [ARCHITECTURE],
        "speculators_model_type": MODEL_TYPE,
        "transformer_layer_config": common.llama_fields(draft, target, dtype),
        "draft_vocab_size": cfg.draft_vocab_size,
        "norm_before_residual": cfg.norm_before_residual,
        "norm_before_fc": False,
        # the architecture's own fields (EAGLE-3.1's fc_norm and norm_output, core/draft.py)
        **own,
        "embed_requires_grad": False,
        "target_hidden_size": cfg.target_hidden_size,
        "eagle_aux_hidden_state_layer_ids": list(cfg.aux_layer_ids),
        "tie_word_embeddings": False,
        # P-EAGLE proposes its block in one pass: the block is what a step speculates
        "speculators_config": common.speculators_block("eagle3", draft, target,
                                                       cfg.block_size or speculative_tokens),
        "torch_dtype": dtype,
        "dtype": dtype,
    }
    # the method's fields win over the defaults above, in their places; the algorithm follows
    # the model type
    fields.update(own)
    fields["speculators_config"]["algorithm"] = fields["speculators_model_type"]
    return fields


def write(directory: Path, draft: Draft, dtype: str, speculative_tokens: int) -> dict[str, Any]:
    """Writes config.json and model.safetensors into `directory`; returns the config."""
    if draft.config.method == dflash.MODEL_TYPE:  # a block drafter's own config and tensors
        return dflash.write("speculators", directory, draft, dtype)
    target = common.check_exportable(draft, min_layer_id=0)
    fields = config(draft, target, dtype, speculative_tokens)
    table = common.export_keys("speculators", draft.config)
    st.save(directory / common.WEIGHTS, common.to_tensors(draft, table, dtype),
            {"format": "pt"})
    return common.write_config(directory, fields)


def is_speculators(config_dict: dict[str, Any]) -> bool:
    return "speculators_model_type" in config_dict


def verifier_name(config_dict: dict[str, Any]) -> str:
    verifier = (config_dict.get("speculators_config") or {}).get("verifier") or {}
    return str(verifier.get("name_or_path") or "")


def read(directory: Path, config_dict: dict[str, Any], tensors: dict[str, Any],
         target: dict[str, Any]):
    """(DraftConfig, DraftWeights, VocabMap) of a speculators checkpoint for `target`."""
    where = directory / "config.json"
    kind = config_dict.get("speculators_model_type")
    if kind == dflash.MODEL_TYPE:
        return dflash.read("speculators", directory, config_dict, tensors, target)
    try:
        method_fields = common.read_method("speculators", config_dict, where)
    except InputError:
        methods = dict.fromkeys(a.method for a in arches.arches())
        raise InputError(f"speculators_model_type {kind!r} is not a draft method eagle3kit "
                         f"reads ({', '.join(methods)})", path=where) from None
    if config_dict.get("norm_before_fc"):
        raise InputError("norm_before_fc: true (one norm over the concatenated states) is not "
                         "supported by eagle3kit's draft head", path=where)
    layer = config_dict.get("transformer_layer_config")
    if not isinstance(layer, dict):
        raise InputError("transformer_layer_config is missing or not an object", path=where)
    if any(k.startswith(f"{LAYER}self_attn.q_norm") for k in tensors):
        raise InputError("the draft layer has q/k norms (a Qwen3 decoder); only the Llama "
                         "decoder that vLLM runs is supported", path=where)
    if layer.get("model_type") not in (None, "llama"):
        common.log.warning("transformer_layer_config.model_type is %r; reading it as the "
                           "Llama decoder vLLM builds", layer.get("model_type"))
    ids = config_dict.get("eagle_aux_hidden_state_layer_ids")
    # vLLM captures in layer order whatever the listed order: that is what fc saw
    ids = tuple(sorted(int(i) for i in ids)) if ids else common.default_aux_ids(target, where)
    cfg = common.read_llama_fields(
        layer, where, draft_vocab_size=config_dict.get("draft_vocab_size"),
        target_hidden_size=common.fc_width(config_dict, tensors, len(ids)), aux_layer_ids=ids,
        # vLLM's reading when the key is absent
        norm_before_residual=bool(config_dict.get("norm_before_residual", True)),
        **method_fields)
    weights, vocab = common.read_weights(tensors, common.export_keys("speculators", cfg),
                                         IGNORED, cfg, directory)
    return cfg, weights, vocab


# ---- the registered format (formats/registry.py) ---------------------------------------------


def detect(directory: Path, config_dict: dict[str, Any] | None) -> bool:
    return config_dict is not None and is_speculators(config_dict)


def load(directory: Path, target: str | None) -> Draft:
    return engine.load(directory, target, "speculators", read, verifier=verifier_name)


def export(draft: Draft, out: Path, options: ExportOptions) -> Path:
    return engine.export(draft, out, options, "speculators",
                         lambda tmp, d: write(tmp, d, options.dtype, options.speculative_tokens))


def serving(cfg: DraftConfig, target: TargetConfig, speculative_tokens: int) -> Serving:
    """vLLM serves it, also by the short form: the config names the verifier."""
    def short_form(repo: str, n: int) -> str:
        return ("The short form `vllm serve " + repo + "` also works: the config names the "
                f"verifier and {speculative_tokens} speculative tokens"
                + (f" (not the {n} above: pass those with --speculative-config)"
                   if n != speculative_tokens else "") + ".\n")

    return Serving("vllm", ("vllm",), tags=("speculators",), notes={"vllm": short_form})
