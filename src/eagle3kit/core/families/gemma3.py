'''Gemma-3 (text): five sliding-window layers to one global one, each with its own rope (local
base 10k; global base 1M, linearly scaled), q/k norms, `(1 + w)` RMSNorms in fp32 with norms
after attention and after the MLP too, a `sqrt(D)`-scaled embedding, queries scaled by
`query_pre_attn_scalar`, a GELU (tanh) MLP and a tied head.

Its GGUF header carries fewer hyper-parameters than its config.json; the rest is what
llama.cpp's loader assumes for `gemma3`: five sliding-window layers to one global layer, a
local rope base of 10,000, and queries scaled by head_dim^-1/2 (hidden/heads for the 27B).
'''

from typing import Any

from eagle3kit.core.config import RopeConfig, layer_windows
from eagle3kit.errors import InputError

MODEL_TYPES = {"gemma3_text": "Gemma3ForCausalLM"}

# Gemma's post_attention_layernorm norms the attention output; the MLP's input norm is
# pre_feedforward_layernorm
HF_KEYS = {
    "layers.mlp_norm": ("model.layers.{i}.pre_feedforward_layernorm.weight", "same"),
    "layers.post_attn_norm": ("model.layers.{i}.post_attention_layernorm.weight", "same"),
    "layers.post_mlp_norm": ("model.layers.{i}.post_feedforward_layernorm.weight", "same"),
}

GGUF_ARCH = "gemma3"
# Gemma's four norms per layer: attn_norm and ffn_norm are the pre-norms, the post_ norms
# norm the attention and MLP outputs.
GGUF_NAMES = [
    (r"blk\.(\d+)\.ffn_norm\.weight", r"model.layers.\1.pre_feedforward_layernorm.weight"),
    (r"blk\.(\d+)\.post_attention_norm\.weight",
     r"model.layers.\1.post_attention_layernorm.weight"),
    (r"blk\.(\d+)\.post_ffw_norm\.weight", r"model.layers.\1.post_feedforward_layernorm.weight"),
]
GGUF_NORMS_PLUS_ONE = True  # llama.cpp stores Gemma's norms as 1 + w (the HF weight is w)
# what llama.cpp's loader assumes for gemma3 when the header does not say
GEMMA3_SLIDING_PATTERN = 6  # layers 6k+5 are global, the five before each sliding
GEMMA3_LOCAL_ROPE_BASE = 10000.0

# GGUF architectures whose tokenizer is transformers' GemmaTokenizer (AutoTokenizer's class
# for these model types; transformers' own GGUF build of it before 5.18 is wrong)
GGUF_TOKENIZER_ARCHS = ("gemma", "gemma2", "gemma3")
TOKENIZER_CLASS = "transformers.models.gemma.tokenization_gemma:GemmaTokenizer"


def fields(d: dict[str, Any], n: int, source: object) -> dict[str, Any]:
    params = d.get("rope_parameters") or {}
    if "full_attention" in params:  # transformers 5.x: one rope per layer type
        rope = RopeConfig.from_hf({"rope_parameters": params["full_attention"]}, source)
        local = RopeConfig.from_hf({"rope_parameters": params["sliding_attention"]}, source)
    else:  # 4.x: rope_theta (+ rope_scaling) for global layers, rope_local_base_freq
        rope = RopeConfig.from_hf(d, source)
        local = RopeConfig(theta=float(d.get("rope_local_base_freq", 10000.0)))
    if d.get("final_logit_softcapping"):  # Gemma-2's; no Gemma-3 release sets it
        raise InputError("final_logit_softcapping is not supported", path=source)
    act = d.get("hidden_activation") or d.get("hidden_act") or "gelu_pytorch_tanh"
    if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise InputError(f"Gemma-3 hidden_activation {act!r} is not supported", path=source)
    return {
        "qk_norm": True,
        "rope": rope, "local_rope": local,
        "layer_windows": layer_windows(d, n, source),
        "query_scale": float(d.get("query_pre_attn_scalar") or d["head_dim"]) ** -0.5,
        "attn_softcap": float(d.get("attn_logit_softcapping") or 0.0),
        "gemma_norms": True, "mlp_activation": "gelu_tanh",
        "tie_word_embeddings": bool(d.get("tie_word_embeddings", True)),
    }


def gguf_config(get, scaling, path) -> dict[str, Any]:
    """The Gemma-3 fields of config.json, from the header or llama.cpp's assumptions."""
    n = int(get("block_count"))
    pattern = get("attention.sliding_window_pattern", GEMMA3_SLIDING_PATTERN)
    if isinstance(pattern, list):  # one bool per layer: sliding or not
        sliding = [bool(x) for x in pattern]
    else:
        sliding = [(i + 1) % int(pattern) != 0 for i in range(n)]
    if scaling not in (None, "none", "linear"):
        raise InputError(f"GGUF rope scaling {scaling!r} is not supported for gemma3 "
                         "(supported: linear)", path=path)
    full: dict[str, Any] = {"rope_type": "default",
                            "rope_theta": float(get("rope.freq_base", 1000000.0))}
    if scaling == "linear":
        full.update(rope_type="linear", factor=float(get("rope.scaling.factor", 1.0)))
    hidden, heads = int(get("embedding_length")), int(get("attention.head_count"))
    head_dim = int(get("attention.key_length", hidden // heads))
    return {
        "sliding_window": int(get("attention.sliding_window")),
        "layer_types": ["sliding_attention" if s else "full_attention" for s in sliding],
        "rope_parameters": {
            "full_attention": full,
            "sliding_attention": {"rope_type": "default", "rope_theta": float(
                get("rope.freq_base_swa", GEMMA3_LOCAL_ROPE_BASE))}},
        # llama.cpp: the 27B (62 layers) scales by hidden/heads, the others by head_dim
        "query_pre_attn_scalar": hidden // heads if n == 62 else head_dim,
        "final_logit_softcapping": get("final_logit_softcapping"),
        "attn_logit_softcapping": get("attn_logit_softcapping"),
        "hidden_activation": "gelu_pytorch_tanh",
    }


# The chat template of Gemma (1, 2, 3) for its base models (`--chat-template gemma`), which
# carry none: <start_of_turn>user|model ... <end_of_turn>; a system message is put before the
# first user message; contents trimmed; roles must alternate from user. It renders a
# string-content conversation exactly as Gemma's own template does, and marks the model's
# turns with {% generation %} (transformers' assistant-token masks).
CHAT_TEMPLATES = {"gemma": """{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
    {%- set prefix = messages[0]['content'] + '\n\n' -%}
    {%- set turns = messages[1:] -%}
{%- else -%}
    {%- set prefix = '' -%}
    {%- set turns = messages -%}
{%- endif -%}
{%- for message in turns -%}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
        {{ raise_exception('roles must alternate user/assistant/user/...') }}
    {%- endif -%}
    {%- if message['role'] == 'assistant' -%}
        {{ '<start_of_turn>model\n' }}
        {%- generation -%}
            {{ message['content'] | trim }}{{ '<end_of_turn>' }}
        {%- endgeneration -%}
        {{ '\n' }}
    {%- else -%}
        {{ '<start_of_turn>' + message['role'] + '\n' + (prefix if loop.first else '') }}
        {{- message['content'] | trim }}{{ '<end_of_turn>\n' }}
    {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{ '<start_of_turn>model\n' }}
{%- endif -%}
"""}
