"""The SGLang / EAGLE / SpecForge ("midlayer") format, as SGLang's `llama_eagle3.py` loads it.

    config.json        LlamaForCausalLMEagle3: a one-layer Llama config plus draft_vocab_size,
                       target_hidden_size and, only for non-default capture layers,
                       eagle_config.eagle_aux_hidden_state_layer_ids in SGLang's convention
    model.safetensors  fc.weight, midlayer.*, norm.weight, lm_head.weight, d2t, t2d
                       (never embed_tokens: SGLang and vLLM use the target's embedding)

SGLang layer ids mean "the output of layer id", i.e. HF hidden_states index - 1; eagle3kit
ids are hidden_states indices. With the default layers the field is omitted, so every reader
(SGLang, vLLM, sglang-jax, forks that read the field in either convention) captures the same.
SGLang's midlayer always adds the un-normed fused state as the residual, so drafts with
`norm_before_residual` cannot be expressed here.

EAGLE-3.1 as SGLang 0.5.23's `llama_eagle3.py` reads it: `fc_norm: true` and the tensors
`fc_norm.{0,1,2}.weight` (an RMSNorm per captured state before fc; SGLang also takes them as
`model.fc_norm.{i}` or its legacy `aux_norm_low/mid/high`, and the flag as `use_aux_norm`), and
`norm_output: true` (the normed state, the one the lm_head reads, is carried to the next step;
false or absent carries the pre-norm state, the standard EAGLE3 recurrence). speculators and
vLLM read `norm_output` in the same sense. `norm_output` is written only when true: SpecForge
0.2.0's training code read the flag in another sense (false dropped the final norm before the
lm_head), so an absent flag is the standard head for every reader. SGLang's `load_weights`
silently skips a tensor it has no parameter for, so the names here are SGLang's exactly.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from eagle3kit.core.config import DraftConfig, TargetConfig
from eagle3kit.errors import InputError, MismatchError
from eagle3kit.formats import common, dflash, engine
from eagle3kit.formats.registry import ExportOptions, Serving
from eagle3kit.io import safetensors as st
from eagle3kit.io.draft_io import Draft

LAYER = "midlayer."
ARCHITECTURE = "LlamaForCausalLMEagle3"
# names other tools give the same architecture
ARCHITECTURES = {ARCHITECTURE, "Eagle3LlamaForCausalLM", "LlamaForCausalLMEagle"}
# tensors found in published midlayer checkpoints that carry nothing eagle3kit needs
IGNORED = ("embed_tokens.weight",)
EXPECTS = f"config.json with {ARCHITECTURE} (SGLang)"


def to_sglang_ids(hf_ids: tuple[int, ...]) -> list[int]:
    return [i - 1 for i in hf_ids]


def from_sglang_ids(ids: list[int]) -> tuple[int, ...]:
    return tuple(int(i) + 1 for i in ids)


def config(draft: Draft, target: TargetConfig, dtype: str) -> dict[str, Any]:
    """config.json exactly as SGLang (and vLLM's midlayer path) read it."""
    cfg = draft.config
    fields: dict[str, Any] = {
        "architectures": [ARCHITECTURE],
        **common.llama_fields(draft, target, dtype),
        "draft_vocab_size": cfg.draft_vocab_size,
        "target_hidden_size": cfg.target_hidden_size,
        # SGLang ignores it; vLLM reads it for this format too (default False)
        "norm_before_residual": False,
    }
    fields.update(common.method(cfg).export_fields("sglang", cfg))
    if cfg.aux_layer_ids != target.default_aux_layer_ids():
        fields["eagle_config"] = {
            "eagle_aux_hidden_state_layer_ids": to_sglang_ids(cfg.aux_layer_ids),
            "use_aux_hidden_state": True,
        }
    return fields


def write(directory: Path, draft: Draft, dtype: str) -> dict[str, Any]:
    """Writes config.json and model.safetensors into `directory`; returns the config."""
    if draft.config.method == dflash.MODEL_TYPE:  # a block drafter's own config and tensors
        return dflash.write("sglang", directory, draft, dtype)
    target = common.check_exportable(draft, min_layer_id=1)
    if draft.config.norm_before_residual:
        raise MismatchError("this draft uses norm_before_residual (residual = normed hidden), "
                            "which SGLang's midlayer cannot express; export it with "
                            "--to speculators and serve it with vLLM")
    fields = config(draft, target, dtype)
    if "eagle_config" in fields:
        common.log.warning(
            "non-default capture layers %s: written as eagle_config ids %s (SGLang's "
            "convention); serve this export with SGLang and use --to speculators for vLLM",
            list(draft.config.aux_layer_ids), fields["eagle_config"][
                "eagle_aux_hidden_state_layer_ids"])
    table = common.export_keys("sglang", draft.config)
    st.save(directory / common.WEIGHTS, common.to_tensors(draft, table, dtype),
            {"format": "pt"})
    return common.write_config(directory, fields)


def is_sglang(config_dict: dict[str, Any]) -> bool:
    return bool(ARCHITECTURES & set(config_dict.get("architectures") or ()))


def aux_layer_ids(config_dict: dict[str, Any], target: dict[str, Any],
                  where: object) -> tuple[int, ...]:
    """HF hidden_states indices from a midlayer config, whichever convention it used."""
    eagle = config_dict.get("eagle_config") or {}
    sglang_ids = eagle.get("eagle_aux_hidden_state_layer_ids")
    hf_ids = config_dict.get("eagle_aux_hidden_state_layer_ids")
    if sglang_ids and hf_ids and sorted(from_sglang_ids(sglang_ids)) != sorted(hf_ids):
        raise InputError(f"ambiguous capture layers: eagle_config says {sglang_ids} (SGLang, "
                         f"output of layer) but eagle_aux_hidden_state_layer_ids says {hf_ids} "
                         "(vLLM, input of layer)", path=where)
    if eagle.get("use_aux_hidden_state") is False:
        raise InputError("use_aux_hidden_state: false (an EAGLE1-style head reading one "
                         "state) is not an EAGLE3 draft", path=where)
    # the engines capture in layer order whatever the listed order: that is what fc saw
    if sglang_ids:
        return tuple(sorted(from_sglang_ids(sglang_ids)))
    if hf_ids:
        return tuple(sorted(int(i) for i in hf_ids))
    return common.default_aux_ids(target, where)


# SGLang's load_weights renames these (substring replace) before matching its parameters
_LEGACY = {"aux_norm_low.": "fc_norm.0.", "aux_norm_mid.": "fc_norm.1.",
           "aux_norm_high.": "fc_norm.2.", "layers.0.": LAYER}


def canonical_names(tensors: dict[str, Any], where: object) -> dict[str, Any]:
    """The tensors under the names written here, from any spelling SGLang's `load_weights`
    accepts: a `model.` prefix, `layers.0.` for `midlayer.`, legacy `aux_norm_low/mid/high`."""
    out: dict[str, Any] = {}
    for name, value in tensors.items():
        new = name.removeprefix("model.")
        for old, repl in _LEGACY.items():
            if new.startswith(old):
                new = repl + new[len(old):]
        if new in out:
            raise InputError(f"tensor {new!r} appears twice (as {name!r} too)", path=where)
        out[new] = value
    return out


def read(directory: Path, config_dict: dict[str, Any], tensors: dict[str, Any],
         target: dict[str, Any]):
    """(DraftConfig, DraftWeights, VocabMap) of a midlayer checkpoint for `target`."""
    if dflash.is_sglang_dflash(config_dict):
        return dflash.read("sglang", directory, config_dict, tensors, target)
    where = directory / "config.json"
    if config_dict.get("tie_word_embeddings"):
        raise InputError("tie_word_embeddings: true makes SGLang use the embedding as the "
                         "head; this checkpoint is not a standard EAGLE3 draft", path=where)
    eagle = config_dict.get("eagle_config") or {}
    if eagle.get("norm_before_fc", config_dict.get("norm_before_fc")):
        raise InputError("norm_before_fc: true (one norm over the concatenated states) is not "
                         "supported by eagle3kit's draft head", path=where)
    tensors = canonical_names(tensors, directory)
    lm_head = tensors.get("lm_head.weight")
    if lm_head is None:
        raise InputError("missing tensor 'lm_head.weight' (a head that borrows the target's "
                         "lm_head is not supported)", path=directory)
    ids = aux_layer_ids(config_dict, target, where)
    cfg = common.read_llama_fields(
        config_dict, where, draft_vocab_size=config_dict.get("draft_vocab_size")
        or lm_head.shape[0], target_hidden_size=common.fc_width(config_dict, tensors, len(ids)),
        aux_layer_ids=ids,
        norm_before_residual=bool(config_dict.get("norm_before_residual", False)),
        **common.read_method("sglang", config_dict, where))
    weights, vocab = common.read_weights(tensors, common.export_keys("sglang", cfg),
                                         IGNORED, cfg, directory)
    return cfg, weights, vocab


# ---- the registered format (formats/registry.py) ---------------------------------------------


def detect(directory: Path, config_dict: dict[str, Any] | None) -> bool:
    return config_dict is not None and (is_sglang(config_dict)
                                        or dflash.is_sglang_dflash(config_dict))


def guess(directory: Path, config_dict: dict[str, Any] | None) -> bool:
    """Midlayer tensors under a generic Llama architecture."""
    return config_dict is not None and any(n.startswith(LAYER)
                                           for n in engine.tensor_names(directory))


def load(directory: Path, target: str | None) -> Draft:
    return engine.load(directory, target, "sglang", read)


def export(draft: Draft, out: Path, options: ExportOptions) -> Path:
    return engine.export(draft, out, options, "sglang",
                         lambda tmp, d: write(tmp, d, options.dtype))


def serving(cfg: DraftConfig, target: TargetConfig, speculative_tokens: int) -> Serving:
    """SGLang serves it; vLLM too when it captures the default layers (the only ones vLLM
    reads from this format)."""
    if cfg.aux_layer_ids == target.default_aux_layer_ids():
        return Serving("sglang", ("sglang", "vllm"))
    return Serving("sglang", ("sglang",), refused={"vllm": (
        "This SGLang-format export reads non-default target layers, recorded in SGLang's "
        "convention, which vLLM does not read. Use the speculators export of the same draft "
        "with vLLM (`eagle3kit convert ... --to speculators`).\n")})
