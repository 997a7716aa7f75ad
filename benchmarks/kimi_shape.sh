#!/usr/bin/env bash
# The Kimi-K2.5 shape on one H200 (BENCHMARKS.md, "Kimi shape"): extract, train and evaluate at
# Kimi-K2.5's sizes (DeepSeek-V3: MLA, MoE, hidden 7168, vocab 163,840) on random-weight slices
# written by benchmarks/kimi_slice.py, in steps that each finish well under 10 minutes:
#
#   bash benchmarks/kimi_shape.sh STEP[,STEP...] OUT_DIR
#
# Steps (times are estimates for one H200 until measured; each step is resumable: what a step
# finished, in the state folder below, is skipped when it runs again on the same machine):
#   pack       (on a machine with network, no GPU) runs/kimi-carry/: the SmolLM2 tokenizer the
#              slices carry, ../shared/data, and the wheels the GPU image may lack (specforge
#              0.2.0 and pytest, pure Python, --no-deps); carry that folder to the GPU machine
#   slice      ~1-2 min  the 6-layer, 64-expert slice (17.7B params, 35.3 GB bf16) in $SLICES
#   extract    ~3-4 min  (writes the slice first if missing) extract_throughput.py on it:
#              fp8 aux + top-64 teacher and bf16 aux + hidden teacher (tokens/s, bytes/token,
#              peak GiB), the raw and decoder-only forwards, the fp8 error of every layer's
#              input at hidden 7168; then kimi_plan.py: `drafter plan` on the slice against
#              those figures, and the rates rescaled to the whole of Kimi-K2.5
#   train      ~4-5 min  train_throughput.py --shape kimi (drafter hidden 7168, vocab 163,840,
#              draft vocab 32,000, 1 x 4,096, TTT 7), top-k and hidden teacher, beside
#              SpecForge 0.2.0's step at the same shape; peak GiB against plan's estimate
#   evaluate-train  ~4-5 min  the 4-layer, 16-expert slice (5.4B params, 10.8 GB), then
#              `drafter run benchmarks/kimi-slice.yaml --until export`: 200 online steps on the
#              shared data's own answers, and the export
#   evaluate   ~3-4 min  (evaluate-train first if it has not finished) drafter evaluate of that
#              export, chain K=5 and tree 6/8/48 at T=0, bf16 with the float32 recheck, at
#              batch 1 (16 prompts) and batch 64 (128 prompts): tau, speedup, x parts, lossless
#   test       ~1 min    pytest -m gpu tests/test_kimi_shape.py (decoder and data engine on a
#              tiny slice)
#   all        every step above but pack, in order (about 17-21 min: more than one call)
#
# Writes into OUT_DIR (made if missing): steps.log (each command, when, its exit status), one
# NAME.log per command (written there as it runs: a call cut short keeps it), and the
# figures: extract.json, plan.json (kimi_plan.py), train.json, evaluate-b1.metrics.json and
# .report.md, evaluate-b64.*, the train and export manifests and the train's metrics
# (evaluate-train.*), test.xml, env.txt (GPU, versions, what imports, free disk). They are kept
# in a state folder ($STATE, runs/kimi-shape) that later steps and calls add to, and copied
# whole into OUT_DIR after each step, so OUT_DIR holds everything finished so far on this
# machine (a machine given back loses the state and the slices: the steps then start over).
#
# Environment: PYTHON (python3), SLICES (/tmp/kimi-slices: 46 GB for both slices), STATE,
# EXTRACT_TOKENS (131072), DATA (runs/kimi-carry/data if there, else ../shared/data),
# TOKENIZER (runs/kimi-carry/tokenizer if there, else builtin:smollm2-135m-instruct).
# KIMI_TINY=1: a CPU check of this script: the same steps at tiny sizes (slices --tiny, a few
# thousand tokens, train_throughput.py --tiny, 4 train steps, 16 new tokens), in
# runs/kimi-shape-tiny and /tmp/kimi-slices-tiny.
# KIMI_DEADLINE (570; KIMI_TINY: 0 = none): seconds from the start after which no command
# runs: each is stopped with SIGTERM (drafter steps unwind and stay resumable) when it would
# pass it, so that a call of 10 minutes returns what finished.
# The exit status is the number of failed commands.
set -uo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
cd "$REPO"
usage() { sed -n '2,/^set -uo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'; exit 2; }
[ $# -eq 2 ] || usage
STEPS=$1
OUT=$2
for s in ${STEPS//,/ }; do
  case "$s" in
    pack|slice|extract|train|evaluate-train|evaluate|test|all) ;;
    *) echo "unknown step '$s'"; usage ;;
  esac
done

PY=${PYTHON:-python3}
CARRY=runs/kimi-carry
if [ "${KIMI_TINY:-0}" = 1 ]; then
  SLICES=${SLICES:-/tmp/kimi-slices-tiny}
  STATE=${STATE:-runs/kimi-shape-tiny}
  RUNS=runs/kimi-slice-tiny
  EXTRACT_TOKENS=${EXTRACT_TOKENS:-4096}
  TINY_SLICE=(--tiny)
  TINY_EXTRACT=(--min-len 64 --max-len 256 --batch-tokens 1024 --shard-tokens 2048
                --fp8-error-tokens 1024)
  TRAIN_SHAPE=(--tiny)
  TINY_RUN=("prepare.sources[0].max_samples=200" "prepare.sources[1].max_samples=50"
            "prepare.sources[2].max_samples=50" train.max_steps=4 train.batch_tokens=1024
            train.max_length=512 tokenize.workers=1)
  TINY_EVAL=(evaluate.max_new_tokens=16)
  EVAL_RECORDS=(1 2)
  NEED_BIG=1 NEED_SMALL=1
else
  SLICES=${SLICES:-/tmp/kimi-slices}
  STATE=${STATE:-runs/kimi-shape}
  RUNS=runs/kimi-slice
  EXTRACT_TOKENS=${EXTRACT_TOKENS:-131072}
  TINY_SLICE=() TINY_EXTRACT=() TRAIN_SHAPE=(--shape kimi) TINY_RUN=() TINY_EVAL=()
  EVAL_RECORDS=(4 32)  # records per set at batch 1 and 64 (MT-bench: two turns each)
  # GB each needs free: the slice (35.3 / 10.8) + extract's shards of one option (7.5 at
  # 131,072 tokens of bf16 + hidden) / the drafter's checkpoint with AdamW and its exports
  NEED_BIG=46 NEED_SMALL=45
fi
BIG=$SLICES/l6-e64
SMALL=$SLICES/l4-e16
if [ -z "${DATA:-}" ]; then
  if [ -d "$CARRY/data" ]; then DATA=$CARRY/data; else DATA=../shared/data; fi
fi
if [ -z "${TOKENIZER:-}" ]; then
  if [ -d "$CARRY/tokenizer" ]; then TOKENIZER=$CARRY/tokenizer
  else TOKENIZER=builtin:smollm2-135m-instruct; fi
fi
export PYTHONPATH="$REPO:/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
DEADLINE=${KIMI_DEADLINE:-570}
[ "${KIMI_TINY:-0}" = 1 ] && DEADLINE=${KIMI_DEADLINE:-0}
START=$(date +%s)
mkdir -p "$OUT" "$STATE"
FAILED=0

note() { echo "[$(date +%H:%M:%S)] $*" | tee -a "$STATE/steps.log" "$OUT/steps.log"; }

step() {  # step NAME CMD...: CMD's output into OUT_DIR/NAME.log (kept in $STATE too); a
  # failure is counted; past KIMI_DEADLINE nothing starts and a running command is stopped
  local name=$1 rc t0 left lim=()
  shift
  t0=$(date +%s)
  if [ "$DEADLINE" -gt 0 ]; then
    left=$(( DEADLINE - (t0 - START) ))
    if [ "$left" -lt 30 ]; then
      note "$name: not started, ${left}s left before KIMI_DEADLINE"
      FAILED=$((FAILED + 1))
      return 124
    fi
    lim=(timeout -s TERM -k 20 "$left")
  fi
  note "$name: $*"
  "${lim[@]}" "$@" > "$OUT/$name.log" 2>&1
  rc=$?
  cp "$OUT/$name.log" "$STATE/$name.log"
  note "$name: exit $rc after $(( $(date +%s) - t0 )) s$([ "$rc" = 124 ] \
    && echo ' (stopped at KIMI_DEADLINE)')"
  [ "$rc" -eq 0 ] || { FAILED=$((FAILED + 1)); tail -n 30 "$OUT/$name.log"; }
  return "$rc"
}

publish() {  # everything in $STATE into OUT_DIR (steps.log: the state's, all calls)
  cp -r "$STATE"/. "$OUT"/ 2>/dev/null || true
}

env_txt() {
  {
    date -u
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1 | head -3
    "$PY" -c "import sys, torch, transformers; print(sys.version.split()[0], torch.__version__,
transformers.__version__)" 2>&1
    for m in pyarrow triton specforge pytest; do
      "$PY" -c "import $m; print('$m', getattr($m, '__version__', ''))" 2>/dev/null \
        || echo "$m: not importable"
    done
    df -h "$REPO" /tmp "$SLICES" 2>/dev/null
  } > "$STATE/env.txt"
}

have_slice() { [ -f "$1/model.safetensors.index.json" ]; }  # the index is written last

free_gb() { local p=$1; while [ ! -e "$p" ]; do p=$(dirname "$p"); done
  df -BG --output=avail "$p" | tail -1 | tr -dc 0-9; }

make_room() {  # make_room GB: below GB free where the slices go, what a finished step no
  # longer needs goes (a 64 GiB disk holds one slice and its step's files, not both of each)
  local need=$1
  [ "$(free_gb "$SLICES")" -ge "$need" ] && return 0
  if [ -d "$BIG" ] && [ -f "$STATE/plan.json" ]; then
    note "$(free_gb "$SLICES") GB free, $need wanted: $BIG removed (extract is done)"
    rm -rf "$BIG"
  fi
  if [ "$(free_gb "$SLICES")" -lt "$need" ] && [ -f "$STATE/evaluate-b64.metrics.json" ]; then
    note "$(free_gb "$SLICES") GB free, $need wanted: $SMALL and $RUNS removed (evaluate is done)"
    rm -rf "$SMALL" "$RUNS" "$RUNS"-b1 "$RUNS"-b64
  fi
  [ "$(free_gb "$SLICES")" -ge "$need" ] || note "only $(free_gb "$SLICES") GB free where the \
slices go, $need wanted: the step may run out of disk"
}

write_slice() {  # write_slice NAME DIR ARGS...: the slice in DIR unless complete there
  local name=$1 dir=$2
  shift 2
  have_slice "$dir" && { note "$dir: complete, kept"; return 0; }
  rm -rf "$dir"
  mkdir -p "$(dirname "$dir")"
  step "$name" "$PY" benchmarks/kimi_slice.py "$dir" --tokenizer "$TOKENIZER" "$@"
}

wheel_installed() {  # wheel_installed MODULE WHEEL...: MODULE importable, else the carry's
  # wheels named WHEEL-* installed into /tmp/site (on PYTHONPATH) and MODULE imported again
  local m=$1 w files=()
  shift
  "$PY" -c "import $m" 2>/dev/null && return 0
  for w in "$@"; do files+=("$CARRY"/wheels/"$w"-*.whl); done
  ls "${files[@]}" > /dev/null 2>&1 || return 1
  "$PY" -m pip install -q --no-index --no-deps --no-compile --target /tmp/site "${files[@]}" \
    >> "$STATE/steps.log" 2>&1
  "$PY" -c "import $m" 2>/dev/null
}

part_pack() {
  mkdir -p "$CARRY/wheels"
  "$PY" - "$CARRY/tokenizer" <<'EOF'
import sys
from transformers import AutoTokenizer
from drafter.core.target import resolve
AutoTokenizer.from_pretrained(resolve("builtin:smollm2-135m-instruct")).save_pretrained(sys.argv[1])
EOF
  rm -rf "$CARRY/data" && mkdir -p "$CARRY/data"
  cp -r ../shared/data/train ../shared/data/eval "$CARRY/data/"
  "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_17_x86_64 -d "$CARRY/wheels" \
    specforge==0.2.0 pytest pluggy iniconfig
  du -sh "$CARRY"
}

part_slice() {
  have_slice "$BIG" || make_room "$NEED_BIG"
  write_slice slice "$BIG" --layers 6 --experts 64 "${TINY_SLICE[@]}"
}

part_extract() {
  have_slice "$BIG" || part_slice || return 0
  [ -f "$STATE/extract.json" ] || step extract "$PY" benchmarks/extract_throughput.py \
    --model "$BIG" --tokens "$EXTRACT_TOKENS" --options fp8/topk,bf16/hidden --fp8-error \
    "${TINY_EXTRACT[@]}" --json "$STATE/extract.json"
  [ -f "$STATE/extract.json" ] && { [ -f "$STATE/plan.json" ] || step plan "$PY" \
    benchmarks/kimi_plan.py "$STATE/extract.json" --json "$STATE/plan.json"; }
  return 0
}

part_train() {
  wheel_installed specforge specforge \
    || note "specforge is not importable and not in $CARRY/wheels: the anchor is skipped"
  [ -f "$STATE/train.json" ] || step train "$PY" benchmarks/train_throughput.py \
    "${TRAIN_SHAPE[@]}" --teacher topk,hidden --memory-peak --json "$STATE/train.json"
  return 0
}

data_overrides() {  # the config's ../shared/data paths under $DATA
  echo "prepare.sources[0].path=$DATA/train/codealpaca_4k.json" \
    "prepare.sources[1].path=$DATA/train/codealpaca_2k.json" \
    "prepare.sources[2].path=$DATA/train/sharegpt_dummy_conversation.json" \
    "evaluate.datasets[0].path=$DATA/eval/mt_bench_questions.jsonl" \
    "evaluate.datasets[1].path=$DATA/eval/humaneval.jsonl.gz" \
    "evaluate.datasets[2].path=$DATA/eval/gsm8k_test.jsonl"
}

part_evaluate_train() {
  have_slice "$SMALL" || [ -f "$RUNS/export/manifest.json" ] || make_room "$NEED_SMALL"
  write_slice small-slice "$SMALL" --layers 4 --experts 16 "${TINY_SLICE[@]}" || return 0
  local m
  [ -f "$RUNS/export/manifest.json" ] \
    || step evaluate-train "$PY" -m drafter.cli run benchmarks/kimi-slice.yaml \
      "target.model=$SMALL" "run_dir=$RUNS" $(data_overrides) "${TINY_RUN[@]}" --until export
  for m in train export; do
    [ -f "$RUNS/$m/manifest.json" ] \
      && cp "$RUNS/$m/manifest.json" "$STATE/evaluate-train.$m-manifest.json"
  done
  [ -f "$RUNS/train/metrics.jsonl" ] \
    && cp "$RUNS/train/metrics.jsonl" "$STATE/evaluate-train.metrics.jsonl"
  return 0
}

part_evaluate() {
  [ -f "$RUNS/export/manifest.json" ] || part_evaluate_train
  [ -f "$RUNS/export/manifest.json" ] || return 0
  local batch n f i=0
  for batch in 1 64; do
    n=${EVAL_RECORDS[$i]}
    i=$((i + 1))
    [ -f "$STATE/evaluate-b$batch.metrics.json" ] && continue
    step "evaluate-b$batch" "$PY" -m drafter.cli evaluate benchmarks/kimi-slice.yaml \
      "target.model=$SMALL" "run_dir=$RUNS-b$batch" $(data_overrides) \
      "evaluate.drafter=$RUNS/export/native" "evaluate.batch_size=$batch" \
      "evaluate.datasets[0].max_prompts=$n" "evaluate.datasets[1].max_prompts=$n" \
      "evaluate.datasets[2].max_prompts=$n" "${TINY_EVAL[@]}" --force
    for f in report.md metrics.json; do
      [ -f "$RUNS-b$batch/evaluate/$f" ] \
        && cp "$RUNS-b$batch/evaluate/$f" "$STATE/evaluate-b$batch.$f"
    done
  done
  return 0
}

part_test() {
  wheel_installed pytest pytest pluggy iniconfig \
    || note "pytest is not importable and not in $CARRY/wheels"
  step test "$PY" -m pytest -m gpu tests/test_kimi_shape.py -q -p no:cacheprovider \
    --junitxml "$STATE/test.xml"
  return 0
}

[ "$STEPS" = pack ] || env_txt
for s in ${STEPS//,/ }; do
  case "$s" in
    all) for p in slice extract train evaluate_train evaluate test; do "part_$p"; publish; done ;;
    evaluate-train) part_evaluate_train ;;
    *) "part_$s" ;;
  esac
  publish
done
note "done ($STEPS): $FAILED failed; figures in $OUT"
publish
exit "$FAILED"
