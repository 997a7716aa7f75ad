#!/usr/bin/env bash
# The GPU reference run (issue 10) and the GPU benchmarks, in resumable phases.
#
#   bash benchmarks/reference_smollm2.sh PHASE [PHASE ...]
#
# phases (each resumes: a finished step is skipped, a killed one continues):
#   tests       pytest -m gpu (graph-captured decoding == eager, flex == exact, preflight ...)
#   speed       decode / train / extract throughput benchmarks (issues 5, 6, 8)
#   reference   the whole pipeline on configs/reference-smollm2.yaml (runs/ref)
#   generate    only prepare + generate of the reference (the longest step)
#   ablations   (a) original answers, (b) top layer only, (c) TTT 1, (d) fp8 + top-k, (e) online;
#               two at a time when two GPUs are visible
#   lanes       on two GPUs until $DEADLINE (epoch seconds), then collect; rerun on the same
#               (warm) machine to continue. GPU 0: the reference, ablation (d), the llama8b train
#               benchmark. GPU 1: GPU tests, ablations (b, e, c), decode speed with the reference
#               drafter, its tree decoding in float32 (treecheck), static vs continuous batching
#   multigpu    2-GPU extract (data parallel) and 2-GPU DDP training throughput
#   restore     unpack a ref-generate.tar.gz of an earlier session ($RESTORE, default
#               .carry_c/ref-generate.tar.gz) into runs/, so the reference resumes after generate
#   collect     metrics, reports, plots, status and logs of every run into $OUT/results.tar.gz
#               (plus ref-generate.tar.gz: the regenerated data, to resume in a later session)
#
# On the lent GPU machine (no network): stage the model and data with ../shared/tools/device-carry.sh
# (see BENCHMARKS.md for the exact calls); the target is then the staged GGUF and the data
# /tmp/drafter-data. Logs and results go to runs/gpu-out; `collect` packs them into $OUT (the lent
# machine returns at most 8 files).
set -uo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
cd "$REPO"
RES=$REPO/runs/gpu-out
OUT=${OUT:-$REPO/runs}
mkdir -p "$OUT" "$RES" runs
source benchmarks/gpu_env.sh   # PYTHONPATH, the staged GGUF and data, NCCL settings
DRAFTER="$PY -m drafter.cli"
TARGET=builtin:smollm2-135m-instruct
NGPU=$($PY -c "import torch; print(torch.cuda.device_count())" 2>/dev/null || echo 0)
CFG=configs/reference-smollm2.yaml
# EXTRA: more overrides for every run (e.g. a tiny CPU rehearsal of this script).
read -r -a EXTRA_ARR <<< "${EXTRA:-}"
BASE=("target.model=$TARGET" "${EXTRA_ARR[@]}")
# The ablations are compared on one setting: chain K=5, greedy, every prompt of the three sets.
ABL_EVAL=("evaluate.methods=[chain]" "evaluate.temperatures=[0.0]")

log() { echo "[$(date +%H:%M:%S)] $*" | tee -a "$RES/phases.log"; }

run() {  # run NAME [overrides...]: the pipeline in runs/NAME, log to runs/gpu-out/NAME.log
  local name=$1; shift
  log "run $name: $*"
  $DRAFTER run "$CFG" "run_dir=runs/$name" "${BASE[@]}" "$@" >> "$RES/$name.log" 2>&1
  local rc=$?
  log "run $name: exit $rc"
  $DRAFTER status "runs/$name" >> "$RES/$name.log" 2>&1
  return $rc
}

seed_from() {  # seed_from SRC DST STEP...: start DST with copies of SRC's finished step folders
  local src=runs/$1 dst=runs/$2; shift 2
  mkdir -p "$dst"
  for s in "$@"; do
    # hard links: finished step files are never rewritten in place (atomic writes), and the
    # reference's features are tens of GB
    [ -f "$src/$s/manifest.json" ] && [ ! -e "$dst/$s" ] && cp -al "$src/$s" "$dst/$s"
  done
  return 0
}

phase_tests() {
  log "tests: pytest -m gpu"
  DRAFTER_TEST_KEEP_CACHE=1 timeout ${T_TESTS:-300} $PY -m pytest -m gpu -q -p no:cacheprovider tests > "$RES/tests-gpu.log" 2>&1
  log "tests: exit $? ($(tail -1 "$RES/tests-gpu.log"))"
}

decode_bench() {  # decode_bench NAME [decode_speed.py args]: results in $RES/NAME.{json,log}
  local name=$1; shift
  log "speed: $name"
  timeout ${T_DECODE:-300} $PY benchmarks/decode_speed.py --target "$TARGET" "$@" \
    --json "$RES/$name.json" > "$RES/$name.log" 2>&1; log "$name exit $?"
}

phase_speed() {
  if [ -d runs/ref/export/native ]; then
    decode_bench decode_speed --drafter runs/ref/export/native
  else
    decode_bench decode_speed
  fi
  log "speed: train"
  timeout ${T_TRAIN:-600} $PY benchmarks/train_throughput.py > "$RES/train_throughput.log" 2>&1
  log "train exit $?"
  log "speed: extract"
  timeout ${T_EXTRACT:-300} $PY benchmarks/extract_throughput.py --model "$TARGET" \
    --json "$RES/extract_throughput.json" > "$RES/extract_throughput.log" 2>&1
  log "extract exit $?"
}

phase_restore() {
  local f=${RESTORE:-.carry_c/ref-generate.tar.gz}
  [ -f "$f" ] || { log "restore: no $f"; return 0; }
  tar -xzf "$f" -C runs && log "restore: $f -> runs/ref"
}

phase_generate() {  # with every visible GPU (engine local runs one replica per GPU)
  timeout $(left 30) bash "$0" _generate; }
phase__generate() { run ref --until generate; }
phase_reference() { run ref; }

# The five ablations: NAME, the steps seeded from the reference, the one change (b trains
# online so as not to store a second set of features; (e) shows online equals offline).
declare -A ABL_SEED=([a_orig]="prepare" [b_top]="prepare generate tokenize vocab"
  [c_ttt1]="prepare generate tokenize vocab extract" [d_fp8]="prepare generate tokenize vocab"
  [e_online]="prepare generate tokenize vocab")
declare -A ABL_ARGS=([a_orig]="generate.enabled=false"
  [b_top]="extract.layer_ids=[29] train.online=true" [c_ttt1]="train.ttt_steps=1"
  [d_fp8]="extract.aux_dtype=fp8 extract.teacher=topk" [e_online]="train.online=true")

wait_for() {  # wait_for FILE: until another lane has produced it
  while [ ! -e "$1" ]; do sleep 5; done
}

once() {  # once NAME CMD...: a phase that is not a resumable run is done once per machine
  [ -f "$RES/done.$1" ] && return 0
  local n=$1; shift
  "$@" && touch "$RES/done.$n"
}

ablate() {  # ablate NAME: one ablation, seeded from the reference's finished steps
  local n=$1 last
  last=${ABL_SEED[$n]##* }
  [ "$n" = a_orig ] || wait_for runs/ref/$last/manifest.json
  seed_from ref "$n" ${ABL_SEED[$n]}
  read -r -a args <<< "${ABL_ARGS[$n]}"
  run "$n" "${args[@]}" "${ABL_EVAL[@]}"
}

speed_drafter() {  # decode speed with the reference drafter, once it is exported
  wait_for runs/ref/export/manifest.json
  decode_bench decode_speed_drafter --drafter runs/ref/export/native
}

left() {  # seconds left before $DEADLINE (epoch seconds; default: an hour from now), minus $1
  echo $(( ${DEADLINE:-$(( $(date +%s) + 3600 ))} - $(date +%s) - ${1:-0} ))
}

treecheck() {  # the reference drafter's tree decoding again, in float32: the strict lossless check
  wait_for runs/ref/export/manifest.json
  log "treecheck: tree, T=0, float32"
  $DRAFTER evaluate "$CFG" run_dir=runs/treecheck "${BASE[@]}" target.dtype=float32 \
    evaluate.drafter=runs/ref/export/native "evaluate.methods=[tree]" "evaluate.temperatures=[0.0]" \
    >> "$RES/treecheck.log" 2>&1; log "treecheck exit $?"
}

# Two lanes, one per GPU, that a rerun continues: each resumable run picks up where it stopped,
# and a finished test phase is not repeated on the same machine. Lane 1 trains the ablations
# that need no stored features of their own two at a time (the drafter is small: one GPU
# interleaves them).
train_bench() {  # issue 6 (b): the Llama-3.1-8B-shaped drafter on random features, one GPU
  log "speed: train, llama8b shape"
  timeout ${T_TRAIN:-600} $PY benchmarks/train_throughput.py --shape llama8b \
    > "$RES/train_llama8b.log" 2>&1; log "train llama8b exit $?"
}

cont_bench() {  # the data engine (engine local) against the static decoder, real prompts
  log "speed: generate throughput"
  timeout ${T_DECODE:-300} $PY benchmarks/generate_throughput.py --prompts 1024 --batches 256 \
    --max-new 512 --static --data ../shared/data/train/gsm8k_train.jsonl \
    --json "$RES/generate_throughput.json" > "$RES/generate_throughput.log" 2>&1
  log "generate throughput exit $?"
}

phase_lane0() {
  # `;`: an evaluate that fails its lossless check (exit 2) still leaves its figures, and the
  # rest of the lane runs
  run ref; ablate d_fp8; once train_bench train_bench; touch "$RES/done.lane0"
}
phase_lane1() {
  once tests phase_tests
  ablate b_top & ablate e_online & wait
  ablate c_ttt1; once speed_drafter speed_drafter; once treecheck treecheck
  once cont_bench cont_bench
  touch "$RES/done.lane1"
}
phase_lanes() {  # both lanes until $DEADLINE (less 20 s to collect), then the 2-GPU runs, collect
  local t=$(left 20)
  CUDA_VISIBLE_DEVICES=0 timeout $t bash "$0" lane0 >> "$RES/lane0.out" 2>&1 &
  CUDA_VISIBLE_DEVICES=1 timeout $t bash "$0" lane1 >> "$RES/lane1.out" 2>&1
  wait
  t=$(left 20)
  if [ -f "$RES/done.lane0" ] && [ -f "$RES/done.lane1" ] && [ ! -f "$RES/done.multigpu" ] \
     && [ $t -gt 60 ]; then
    timeout $t bash "$0" multigpu >> "$RES/multigpu.out" 2>&1 && touch "$RES/done.multigpu"
  fi
  phase_collect
}

phase_ablations() {  # the five after the reference, two at a time when two GPUs are visible
  local i=0
  for n in a_orig b_top c_ttt1 d_fp8 e_online; do
    if [ "$NGPU" -ge 2 ]; then
      CUDA_VISIBLE_DEVICES=$((i % 2)) ablate "$n" &
      i=$((i + 1))
      [ $((i % 2)) -eq 0 ] && wait
    else
      ablate "$n"
    fi
  done
  wait
}

phase_multigpu() {
  [ "$NGPU" -ge 2 ] || { log "multigpu: needs 2 GPUs, $NGPU visible"; return 0; }
  log "multigpu: extract, 2 ranks"
  seed_from ref x2 prepare generate tokenize vocab
  timeout 600 $PY -m torch.distributed.run --standalone --nproc-per-node 2 -m drafter.cli extract \
    "$CFG" run_dir=runs/x2 "${BASE[@]}" > "$RES/x2-extract.log" 2>&1; log "x2 extract exit $?"
  log "multigpu: DDP training throughput, 2 ranks, llama8b shape"
  timeout 600 $PY -m torch.distributed.run --standalone --nproc-per-node 2 \
    benchmarks/train_throughput.py --shape llama8b > "$RES/train_ddp2.log" 2>&1
  log "ddp2 exit $?"
}

phase_collect() {
  for d in runs/*/; do
    name=$(basename "$d")
    [ -f "$d/config.yaml" ] || continue
    $DRAFTER status "$d" --json > "$RES/$name.status.json" 2>/dev/null
    for f in evaluate/metrics.json evaluate/report.md evaluate/acceptance.png evaluate/tau.png \
             train/metrics.jsonl; do
      [ -f "$d/$f" ] && cp "$d/$f" "$RES/$name.$(basename "$f")"
    done
  done
  tar -czf "$OUT/results.tar.gz" -C "$RES" .
  cp "$RES/phases.log" "$OUT/phases.log" 2>/dev/null
  # the regenerated conversations, so that a later session can resume after generate
  # (about 10 MB for the 15,002 conversations; also once generate is done: a later session
  # restores it instead of regenerating)
  if [ -d runs/ref/generate ]; then
    tar -czf "$OUT/ref-generate.tar.gz" -C runs ref/config.yaml ref/prepare ref/generate
  fi
  log "collect: $(ls "$RES" | wc -l) files packed into $OUT/results.tar.gz"
}

[ $# -gt 0 ] || { sed -n '2,/^set -uo/p' "$0" | sed '$d'; exit 2; }
log "start: $* (GPUs: $NGPU, target: $TARGET, torch $($PY -c 'import torch; print(torch.__version__)'))"
for p in "$@"; do "phase_$p"; done
log "end: $*"
