"""Target families: Llama (and Mistral), Qwen2 (Qwen2.5, Qwen2.5-Coder), Qwen3, Qwen3-MoE,
gpt-oss and Gemma-3 (text), and any other registered in `registry` (one line below per
family; docs/architecture.md says how). `core/config.py`, `io/hf.py`, `io/gguf.py` and
`data/tokenizer.py` look a family up here; none of them names one.
"""

from __future__ import annotations

from eagle3kit.core.families.registry import (
    by_gguf_arch,
    by_model_type,
    families,
    get,
    names,
    register,
    unregister,
)

register("llama", "eagle3kit.core.families.llama")
register("qwen2", "eagle3kit.core.families.qwen2")
register("qwen3", "eagle3kit.core.families.qwen3")
register("qwen3_moe", "eagle3kit.core.families.qwen3_moe")
register("gpt_oss", "eagle3kit.core.families.gpt_oss")
register("gemma3", "eagle3kit.core.families.gemma3")

__all__ = ["by_gguf_arch", "by_model_type", "families", "get", "names", "register",
           "unregister"]
