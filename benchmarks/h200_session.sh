#!/usr/bin/env bash
# One GPU session on the lent 2 x H200 machine (issues 14, 15, 18, 20): benchmarks, synthetic
# prompts, the scaling run and its comparisons, in two GPU lanes, in the background.
#
#   bash benchmarks/h200_session.sh start     # starts the lanes as a daemon (setsid), returns
#   bash benchmarks/h200_session.sh wait N    # waits up to N seconds for both lanes, then collect
#   bash benchmarks/h200_session.sh collect   # results into $OUT (at most 8 files of 16 MiB)
#
# The lanes outlive the call that starts them (a new process session), so the work runs across
# device calls as long as the machine stays held: each later call `wait`s and collects, so
# whatever finished comes back even if the machine is lost after it. Logs: runs/gpu-out/.
# On one GPU (`single`) the same work runs in turn, without the pools-only comparisons, the
# scale run on the first $SCALE_SYNTHETIC (40,000, as the config) synthetic prompts.
#
#   lane 0 (GPU 0): GPU tests -> data engine throughput, 10,000 prompts, batch 1024/2048/512/256
#                   (+ kernel profile) -> [2 GPUs: the same on both GPUs; the scale run's
#                   prepare + generate] -> scale: tokenize, vocab, train online (one pass,
#                   checkpoints) -> export, evaluate (chain + tree, T 0 and 1)
#   lane 1 (GPU 1): synthetic prompts (100,000, diversity vs the pools) -> [2 GPUs, as above]
#                   -> pools only (the reference data): generate, train 3 epochs, truncated
#                   answers kept vs dropped (tokenize.drop_truncated), evaluate both (chain K=5)
#                   -> the tau-vs-tokens curve (the scale run's checkpoints, chain K=5, T=0)
#                   -> the training benchmark (issue 18; $TRAIN_BENCH: its arguments)
set -uo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
cd "$REPO"
source benchmarks/lanes.sh
source benchmarks/gpu_env.sh
DRAFTER="$PY -m drafter.cli"
CFG=configs/scale-smollm2.yaml
CURVE_EVAL=("evaluate.methods=[chain]" "evaluate.temperatures=[0.0]")
# checkpoints of the scale run (save_every 470 steps of 16,384 tokens: ~7.7M tokens apart)
CURVE_STEPS=${CURVE_STEPS:-470 940 1410}

step() {  # step NAME GPUS CMD...: run, log to runs/gpu-out/NAME.log, never stop the lane
  local name=$1 gpus=$2; shift 2
  log "$name: start (GPU $gpus)"
  CUDA_VISIBLE_DEVICES=$gpus "$@" >> "$RES/$name.log" 2>&1
  log "$name: exit $?"
}

lane0() {
  step tests 0 $PY -m pytest -m gpu -q -p no:cacheprovider tests/test_engine.py \
    tests/test_decode.py tests/test_model.py tests/test_extract.py
  step throughput 0 $PY benchmarks/generate_throughput.py --data ../shared/data/train \
    --prompts 10000 --batches 1024,2048,512,256 --max-new 512 --profile \
    --json "$RES/throughput.json"
  mark lane0-free; await lane1-free
  step throughput-2gpu 0,1 $PY benchmarks/generate_throughput.py --data ../shared/data/train \
    --prompts 10000 --batches 1024 --max-new 512 --all-gpus --json "$RES/throughput-2gpu.json"
  step scale-generate 0,1 $DRAFTER run $CFG --until generate
  mark generated
  step scale-train 0 $DRAFTER run $CFG --until train
  mark trained
  step scale-eval 0 $DRAFTER run $CFG
  mark lane0
}

single() {  # one GPU: the two lanes' work in turn, most wanted first, the scale run on the
            # first $SCALE_SYNTHETIC synthetic prompts; the GPU tests after the runs
  step throughput 0 $PY benchmarks/generate_throughput.py --data ../shared/data/train \
    --prompts 10000 --batches 1024,2048,512,256 --max-new 512 --profile \
    --json "$RES/throughput.json"
  step synthetic 0 $PY benchmarks/synthetic_prompts.py --count 100000 --batch 2048 \
    --max-tokens 128 --out runs/synthetic-100k.jsonl.gz --compare ../shared/data/train \
    --json "$RES/synthetic.json"
  local half=("prepare.sources[6].max_samples=${SCALE_SYNTHETIC:-40000}")
  step scale-generate 0 $DRAFTER run $CFG "${half[@]}" --until generate
  step scale-train 0 $DRAFTER run $CFG "${half[@]}" --until train
  step scale-eval 0 $DRAFTER run $CFG "${half[@]}"
  curve 0
  step decode-speed 0 $PY benchmarks/decode_speed.py --batches 1,64 --json "$RES/decode_speed.json"
  step tests 0 $PY -m pytest -m gpu -q -p no:cacheprovider tests/test_engine.py \
    tests/test_decode.py tests/test_model.py tests/test_extract.py
  step train-bench 0 $PY benchmarks/train_throughput.py ${TRAIN_BENCH:-}
  mark lane0; mark lane1
}

curve() {  # the tau-vs-tokens curve: chain K=5, T=0 on the scale run's checkpoints
  for s in $CURVE_STEPS; do
    ck=$(printf "runs/scale/train/step_%06d" "$s")
    [ -d "$ck" ] || continue
    step "curve-$s" "$1" $DRAFTER evaluate $CFG "run_dir=runs/curve-$s" "evaluate.drafter=$ck" \
      "${CURVE_EVAL[@]}"
  done
}

lane1() {
  step synthetic 1 $PY benchmarks/synthetic_prompts.py --count 100000 --batch 2048 \
    --max-tokens 128 --out runs/synthetic-100k.jsonl.gz --compare ../shared/data/train \
    --json "$RES/synthetic.json"
  mark lane1-free; await generated
  local pools=("run_dir=runs/pools" "prepare.sources[6].max_samples=0" "train.epochs=3"
               "train.save_every=1000" "evaluate.methods=[chain]" "evaluate.temperatures=[0.0]")
  step pools 1 $DRAFTER run $CFG "${pools[@]}"
  mkdir -p runs/pools-drop
  for s in prepare generate; do   # the same conversations: only tokenize differs
    [ -d runs/pools/$s ] && [ ! -e runs/pools-drop/$s ] && cp -al runs/pools/$s runs/pools-drop/
  done
  step pools-drop 1 $DRAFTER run $CFG "${pools[@]}" run_dir=runs/pools-drop \
    tokenize.drop_truncated=true
  await trained
  curve 1
  step decode-speed 1 $PY benchmarks/decode_speed.py --batches 1,64 --json "$RES/decode_speed.json"
  step train-bench 1 $PY benchmarks/train_throughput.py ${TRAIN_BENCH:-}
  mark lane1
}

collect() {
  collect_runs
  [ -f runs/synthetic-100k.jsonl.gz ] && cp runs/synthetic-100k.jsonl.gz "$OUT/"
  # the regenerated conversations, for a later session (in parts: 16 MiB a file comes back)
  if [ -f runs/scale/generate/manifest.json ] && [ ! -f "$OUT/scale-generate.tar.gz.aa" ]; then
    tar -czf - -C runs scale/config.yaml scale/prepare scale/generate \
      | split -b 15M - "$OUT/scale-generate.tar.gz."
  fi
  log "collect: $(ls "$RES" | wc -l) files in results.tar.gz; $(ls "$OUT" | wc -l) files out"
}

case "${1:-}" in
  start)
    n=$($PY -c 'import torch; print(torch.cuda.device_count())')
    log "start (GPUs: $n)"
    if [ "$n" -ge 2 ]; then
      setsid bash "$0" lane0 < /dev/null > "$RES/lane0.out" 2>&1 &
      setsid bash "$0" lane1 < /dev/null > "$RES/lane1.out" 2>&1 &
    else
      setsid bash "$0" single < /dev/null > "$RES/single.out" 2>&1 &
    fi
    sleep 2; log "lanes started" ;;
  single) single ;;
  lane0) lane0 ;;
  lane1) lane1 ;;
  wait)
    end=$(( $(date +%s) + ${2:-500} ))
    while [ "$(date +%s)" -lt "$end" ] && ! { [ -f "$RES/lane0.done" ] && [ -f "$RES/lane1.done" ]; }; do
      sleep 5
    done
    collect; tail -n 40 "$RES/phases.log"
    nvidia-smi --query-gpu=index,memory.used,utilization.gpu --format=csv,noheader ;;
  collect) collect ;;
  *) sed -n '2,/^set -uo/p' "$0" | sed '$d'; exit 2 ;;
esac
