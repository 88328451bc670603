"""Llama (Llama-2/3, incl. Llama-3 rope scaling; SmolLM2) and Mistral-style checkpoints, which
are Llama without sliding windows: the layer every other family varies. Its weights are
io/hf's table as it stands, and GGUF's names are io/gguf's own."""

MODEL_TYPES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM"}

GGUF_ARCH = "llama"
# llama.cpp's converter interleaves the rotary halves of q and k for this architecture
GGUF_ROTARY_PERMUTED = True
