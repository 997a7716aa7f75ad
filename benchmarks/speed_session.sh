#!/usr/bin/env bash
# Issue 18's GPU session (training speed) on one H200, from a bare machine: nothing restored, the
# real run's data answered on the machine from ../shared/data (benchmarks/speed-smollm2.yaml).
#
#   bash benchmarks/speed_session.sh start     # the lane as a daemon (setsid), returns
#   bash benchmarks/speed_session.sh wait N    # waits up to N seconds for it, collects results
#                                              # into $OUT/results.tar.gz
#   CHECK=1 bash benchmarks/speed_session.sh lane   # here, without a GPU: every drafter
#                                      # command's config resolved (`drafter config`), nothing run
#
# Needs the staging calls of BENCHMARKS.md first (the GGUF, the shared data, the wheels) and
# SpecForge's wheel in .whl/ for the anchor. The lane, alone on the GPU, nvidia-smi throughout:
#   1 the GPU tests of tests/test_model.py (the merge's Triton kernels compiled, flex vs sdpa)
#   2 the SmolLM2 shape (train_throughput.py, random features, top-k teacher): the merge's
#     Triton kernels against its eager ops, alternating, twice each
#   3 Llama-8B at 4,096: the same A/B, then beside SpecForge twice (top-k and hidden teachers)
#   4 the real run: its answers (a process of its own), then vocab .. train cold in one process
#     and `drafter train --force` warm, each under TORCH_TRACE (which cache-key component makes
#     a train after a cold run miss Inductor's cache?), then warm at train.loss_chunk=8192
#   5 the SmolLM2 shape at loss chunks of 8,192 and 16,384 rows (2,097, the automatic size at
#     Vd 32,000, is in 2), then under torch.profiler
# (run in the fourteenth session, at 1187bb3: BENCHMARKS.md)
#
#   bash benchmarks/speed_session.sh start-next   # the sixteenth session's lane (its machine
#   was lost after step 2's second run: steps 3-5 have not run; with gpu_env.sh's bytecode
#   prefix since 9a10bd5, a rerun also measures warm-ups without the image's source compiles):
#   1 the GPU tests of tests/test_train.py (the train-after-precompile test, its environment
#     fixed in 0d28b1c; the first step's parts)
#   2 the real run cold with extract's precompile (started first now, cc1ea9b), three times in
#     fresh caches: avg/steady 0.851 and 0.847 in the fifteenth session against the goal's 0.85;
#     each warm-up's first step in parts (warmup_first_step_s)
#   3 where a warm warm-up and the precompile process go: a warm train (100 steps) and a cold
#     `drafter precompile` under cProfile (pstats text by cumulative and own time)
#   4 a warm train with Inductor's compile workers off (TORCHINDUCTOR_COMPILE_THREADS=1)
#   5 loss chunks auto / 16,384 rows at the SmolLM2 shape (100 steps, twice), then Llama-8B at
#     4,096 with 16,384-row loss chunks
#
#   bash benchmarks/speed_session.sh start-a17   # the seventeenth session's first lane: the
#   real run's answers made (and packed into $OUT/speed-answers.tar.xz for a later machine),
#   then the cold runs with precompile again, now with bytecode (gpu_env.sh since 9a10bd5):
#   three in fresh Inductor caches (F, G, H), a cold `drafter precompile` under cProfile, a warm
#   train with Inductor's compile workers off (TORCHINDUCTOR_COMPILE_THREADS=1)
#
#   bash benchmarks/speed_session.sh start-b17   # the seventeenth session's second lane, on a
#   fresh machine with .carry_c/speed-answers.tar.xz (lane a17's answers) carried: bytecode
#   written at last (gpu_env.sh unsets the image's PYTHONDONTWRITEBYTECODE); one extract with
#   precompile in a fresh Inductor cache, then four trains reading it, train.gc_freeze on, off,
#   on, off (I, J, K, L); the loss chunks auto / 16,384 at the SmolLM2 shape (100 steps), then
#   Llama-8B at 4,096 with 16,384-row chunks
#
#   bash benchmarks/speed_session.sh start-c18   # the eighteenth session's lane, with
#   .carry_c/speed-answers.tar.xz carried: extract's precompile now saves train's pieces whole
#   (drafter/aot.py); one cold extract, a 500-step train first after it, six 200-step trains
#   (the pieces loaded whole and train.saved_graphs=false alternating), a 500-step train; a
#   second cold extract and a 200-step train first after it, a 500-step one; the GPU tests of
#   tests/test_train.py
#
#   bash benchmarks/speed_session.sh start-d18   # its second lane, on a fresh machine: the GPU
#   tests of tests/test_train.py, then two more cold extracts, each followed by 200-step trains
#   (three, then two) with the pieces loaded whole
#
#   bash benchmarks/speed_session.sh start-e19   # the nineteenth session's lane: the GPU tests
#   of tests/test_train.py, then 200-step trains after a cold extract with train's first step
#   made ahead on a thread (train.prewarm) or not, alternating (w1 o1 .. w4 o4), a second cold
#   extract, o5 w5 o6 w6 (run at 9afb541; train.prewarm is gone since 32027ac: no rerun)
#
#   bash benchmarks/speed_session.sh start-f19   # its second lane, SpecForge's wheel in .whl
#   carried (nothing staged): issue 18's table beside SpecForge in one call (SmolLM2 shape,
#   Llama-8B at 2,048 and 4,096, top-k and hidden teachers)
#
#   bash benchmarks/speed_session.sh start-g20   # the twentieth session's lane: train's loader
#   started before the model, meant against the tree before it (.carry_d; as run, its o trains
#   ran this tree: lane_g20), 200-step trains after one cold extract; a profiled 10-step train;
#   the GPU tests of tests/test_train.py
#
#   bash benchmarks/speed_session.sh start-h20   # its second lane: the image's bytecode compiled
#   first, then the A/B lane g20 meant (the tree before the change run with python -P)
#
#   bash benchmarks/speed_session.sh start-i21   # not yet run: the batch builders on one
#   intra-op thread (88dd702) against the tree before (a084507 in .carry_d)
#
#   bash benchmarks/speed_session.sh start-j21   # the twenty-first session: the merge's Triton
#   kernels compiled into Inductor's Triton cache in every process (precompile.share_triton_cache)
#   against the tree before (.carry_d from `git archive 5fa95f6 drafter | gzip`): three cold
#   extracts with two 200-step trains after each, the tree before's first; the GPU tests of
#   tests/test_train.py
#
#   bash benchmarks/speed_session.sh start-k21   # its second lane: what `drafter run` does,
#   five times: a cold extract, then one 200-step train (this tree)
#
#   bash benchmarks/speed_session.sh start-pre   # the fifteenth session's lane: precompiling
#   1 the GPU tests of tests/test_model.py and tests/test_train.py (a train after `drafter
#     precompile` finds every graph in Inductor's cache; extract's precompile beside the target)
#   2 the real run's answers, then the real run cold in fresh Inductor caches: A without
#     precompiling (extract.precompile=false), B with it (extract's default), A and B again:
#     each extract's seconds and precompile figures, each train's warm-up, FX-cache hits and
#     avg/steady (goal >= 0.85; 0.717 cold in the fourteenth session)
#   3 online against offline (goal >= 0.7x), the SmolLM2 shape beside SpecForge, Llama-8B
#     beside SpecForge at 2,048 twice (1.31x / 1.32x once)
set -uo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
cd "$REPO"
source benchmarks/lanes.sh   # also the GPU environment, PY and DRAFTER
CFG=benchmarks/speed-smollm2.yaml
TT=benchmarks/train_throughput.py

keep_train() {  # keep_train TAG: the real run's train manifest and metrics as speed-TAG.train.*
  local v
  for v in manifest.json metrics.jsonl; do
    cp runs/speed/train/$v "$RES/speed-$1.train.$v" 2>/dev/null
  done
}

start_lane() {  # nvidia-smi once a second into $RES/smi.csv (its pid in SMI), SpecForge
  # from .whl into /tmp/sf (on PYTHONPATH) for the anchor; nothing under CHECK
  export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}/tmp/sf"
  [ -n "${CHECK:-}" ] && return
  nvidia-smi --query-gpu=timestamp,utilization.gpu,clocks.sm,power.draw,memory.used \
    --format=csv -lms 1000 > "$RES/smi.csv" 2>&1 &
  SMI=$!
  rm -rf /tmp/sf && mkdir -p /tmp/sf
  ls .whl/specforge-*.whl > /dev/null 2>&1 && $PY -m pip install -q --no-index --no-deps \
    --target /tmp/sf .whl/specforge-*.whl || log "SpecForge not installed: no anchor"
}

lane() {
  local v
  start_lane
  step gpu-tests $PY -m pytest -q -m gpu -p no:cacheprovider tests/test_model.py
  for v in a b; do
    step smollm2-fused-$v $PY $TT --shape smollm2 --teacher topk --no-anchor
    step smollm2-eager-$v $PY $TT --shape smollm2 --teacher topk --no-anchor --no-fused-merge
  done
  step llama-fused $PY $TT --shape llama8b --seq 4096 --teacher topk --no-anchor
  step llama-eager $PY $TT --shape llama8b --seq 4096 --teacher topk --no-anchor --no-fused-merge
  for v in a b; do
    step llama-sf-$v $PY $TT --shape llama8b --seq 4096 --teacher topk,hidden
  done
  step speed-generate $DRAFTER run $CFG --until generate
  TORCH_TRACE="$RES/trace-cold" step speed-cold $DRAFTER run $CFG --until train
  keep_train cold
  TORCH_TRACE="$RES/trace-warm" step speed-warm $DRAFTER train $CFG --force
  keep_train warm
  step cache-keys $PY benchmarks/cache_keys.py "$RES/trace-cold" "$RES/trace-warm"
  if [ -z "${CHECK:-}" ]; then  # the raw traces come back only if small enough (16 MiB a file)
    tar -cJf "$OUT/traces.tar.xz" -C "$RES" trace-cold trace-warm 2>/dev/null
    [ "$(stat -c %s "$OUT/traces.tar.xz" 2>/dev/null || echo 0)" -lt 15000000 ] \
      || rm -f "$OUT/traces.tar.xz"
    rm -rf "$RES/trace-cold" "$RES/trace-warm"
  fi
  step speed-warm-chunk8192 $DRAFTER train $CFG train.loss_chunk=8192 --force
  keep_train warm-chunk8192
  for v in 8192 16384; do
    step smollm2-chunk-$v $PY $TT --shape smollm2 --teacher topk --no-anchor --loss-chunk $v
  done
  step smollm2-profile $PY $TT --shape smollm2 --teacher topk --no-anchor \
    --profile "$RES/train-profile"
  [ -n "${SMI:-}" ] && kill "$SMI" 2>/dev/null
  mark lane
}

beside_specforge() {  # online against offline, then the SmolLM2 shape and Llama-8B at 2,048
  # (twice) beside SpecForge
  local v
  step online $PY $TT --real --online --online-group 4 --shape smollm2 --no-anchor
  step smollm2-sf $PY $TT --shape smollm2 --teacher topk,hidden
  for v in a b; do
    step llama-sf-2048-$v $PY $TT --shape llama8b --seq 2048 --teacher topk,hidden
  done
}

lane_next() {
  local v c
  start_lane
  step gpu-tests $PY -m pytest -q -m gpu -p no:cacheprovider tests/test_train.py
  step speed-generate $DRAFTER run $CFG --until vocab
  for v in c d e; do
    cold "pre-$v" true
  done
  prof_warm_train
  prof_precompile
  TORCHINDUCTOR_CACHE_DIR=/tmp/inductor-pre-e TORCHINDUCTOR_COMPILE_THREADS=1 \
    step speed-warm-threads1 $DRAFTER train $CFG --force
  keep_train warm-threads1
  for v in a b; do
    for c in 0 16384; do
      step smollm2-chunk$c-$v $PY $TT --shape smollm2 --teacher topk --no-anchor --steps 100 \
        --loss-chunk $c
    done
  done
  step llama-4096-chunk16384 $PY $TT --shape llama8b --seq 4096 --teacher topk --no-anchor \
    --loss-chunk 16384
  [ -n "${SMI:-}" ] && kill "$SMI" 2>/dev/null
  mark lane
}

lane_a17() {
  local v
  start_lane
  step speed-generate $DRAFTER run $CFG --until vocab
  pack_answers
  for v in f g h; do
    cold "pre-$v" true
  done
  prof_precompile
  TORCHINDUCTOR_CACHE_DIR=/tmp/inductor-pre-h TORCHINDUCTOR_COMPILE_THREADS=1 \
    step speed-warm-threads1 $DRAFTER train $CFG --force
  keep_train warm-threads1
  [ -n "${SMI:-}" ] && kill "$SMI" 2>/dev/null
  mark lane
}

lane_b17() {
  local v c ind=/tmp/inductor-gc
  start_lane
  bytecode_state
  restore_answers
  rm -rf "$ind"
  TORCHINDUCTOR_CACHE_DIR=$ind step speed-gc-extract $DRAFTER extract $CFG --force
  keep_extract gc
  for v in i:true j:false k:true l:false; do
    TORCHINDUCTOR_CACHE_DIR=$ind step "speed-gc-${v%%:*}" $DRAFTER train $CFG \
      "train.gc_freeze=${v#*:}" --force
    keep_train "gc-${v%%:*}"
  done
  bytecode_state
  for c in 0 16384; do
    step smollm2-chunk$c $PY $TT --shape smollm2 --teacher topk --no-anchor --steps 100 \
      --loss-chunk $c
  done
  step llama-4096-chunk16384 $PY $TT --shape llama8b --seq 4096 --teacher topk --no-anchor \
    --loss-chunk 16384
  [ -n "${SMI:-}" ] && kill "$SMI" 2>/dev/null
  mark lane
}

lane_c18() {  # the eighteenth session: train's pieces loaded whole (drafter/aot.py)
  local v ind=/tmp/inductor-c18
  start_lane
  bytecode_state
  restore_answers
  rm -rf "$ind"
  TORCHINDUCTOR_CACHE_DIR=$ind step speed-aot-p1-extract $DRAFTER extract $CFG --force
  keep_extract aot-p1
  [ -z "${CHECK:-}" ] && log "saved pieces: $(ls $ind/drafter-aot 2>&1 | tr '\n' ' ')"
  # A: the first train after the cold extract, 500 steps; then 200-step trains, the pieces
  # loaded whole (s) or compiled from Inductor's cache as before (j), alternating
  TORCHINDUCTOR_CACHE_DIR=$ind step speed-aot-a1 $DRAFTER train $CFG --force
  keep_train aot-a1
  for v in s1:true j1:false s2:true j2:false s3:true j3:false; do
    TORCHINDUCTOR_CACHE_DIR=$ind step "speed-aot-${v%%:*}" $DRAFTER train $CFG \
      train.max_steps=200 "train.saved_graphs=${v#*:}" --force
    keep_train "aot-${v%%:*}"
  done
  TORCHINDUCTOR_CACHE_DIR=$ind step speed-aot-a2 $DRAFTER train $CFG --force
  keep_train aot-a2
  # a second cold extract, then a 200-step train first after it
  rm -rf "$ind"
  TORCHINDUCTOR_CACHE_DIR=$ind step speed-aot-p2-extract $DRAFTER extract $CFG --force
  keep_extract aot-p2
  TORCHINDUCTOR_CACHE_DIR=$ind step speed-aot-s4 $DRAFTER train $CFG train.max_steps=200 \
    --force
  keep_train aot-s4
  TORCHINDUCTOR_CACHE_DIR=$ind step speed-aot-a3 $DRAFTER train $CFG --force
  keep_train aot-a3
  step gpu-tests $PY -m pytest -q -m gpu -p no:cacheprovider tests/test_train.py
  [ -n "${SMI:-}" ] && kill "$SMI" 2>/dev/null
  mark lane
}

lane_d18() {  # the eighteenth session's second lane: the GPU tests, then 200-step trains
  # after two more cold extracts (the pieces loaded whole)
  start_lane
  restore_answers
  step gpu-tests $PY -m pytest -q -m gpu -p no:cacheprovider tests/test_train.py
  trains_after_cold aot /tmp/inductor-d18 no_overrides this_tree p3:s5,s6,s7 p4:s8,s9
  [ -n "${SMI:-}" ] && kill "$SMI" 2>/dev/null
  mark lane
}

lane_e19() {  # the nineteenth session: train's first step made ahead on a thread while it
  # sets up (train.prewarm): 200-step trains after a cold extract, prewarm on (w) and off (o)
  # alternating, then a second cold extract with two more of each; the GPU tests first. Ran at
  # 9afb541; train.prewarm was taken out after it (32027ac), so its trains no longer run here:
  # the config refuses the key (a rerun of its o trains: lane_d18's shape, no_overrides)
  start_lane
  restore_answers
  step gpu-tests $PY -m pytest -q -m gpu -p no:cacheprovider tests/test_train.py
  trains_after_cold pw /tmp/inductor-e19 prewarm_override this_tree p1:w1,o1,w2,o2,w3,o3,w4,o4 \
    p2:o5,w5,o6,w6
  [ -n "${SMI:-}" ] && kill "$SMI" 2>/dev/null
  mark lane
}

trains_after_cold() {  # trains_after_cold TAG IND OVERRIDES TREE SPEC...: per SPEC
  # "pN:t1,t2,..", a cold extract (its precompile into a fresh Inductor cache IND:
  # speed-TAG-pN-extract), then 200-step trains t1, t2 .. reading that cache (speed-TAG-t1 ..);
  # `OVERRIDES t` prints train t's extra config overrides, `TREE t` its drafter command
  # (this_tree, or tree_for: the tree before for o.., an extract "opN" too); the Triton kernels
  # logged after each
  local tag=$1 ind=$2 over=$3 tree=$4 v t ts
  shift 4
  for v in "$@"; do
    rm -rf "$ind"
    # shellcheck disable=SC2046  # the command is words
    TORCHINDUCTOR_CACHE_DIR=$ind step "speed-$tag-${v%%:*}-extract" $($tree "${v%%:*}") \
      extract $CFG --force
    keep_extract "$tag-${v%%:*}"
    triton_kernels "$ind" "after the extract"
    ts=${v#*:}
    for t in ${ts//,/ }; do
      # shellcheck disable=SC2046  # the command and the overrides are words
      TORCHINDUCTOR_CACHE_DIR=$ind step "speed-$tag-$t" $($tree "$t") train $CFG \
        train.max_steps=200 $($over "$t") --force
      keep_train "$tag-$t"
      triton_kernels "$ind" "after train $t"
    done
  done
}

no_overrides() { :; }
this_tree() { echo "$DRAFTER"; }
prewarm_override() { [ "${1:0:1}" = w ] && echo train.prewarm=true || echo train.prewarm=false; }

lane_f19() {  # the nineteenth session's second lane: issue 18's table at one commit, in one
  # call, beside SpecForge (no model, no data: random features, train_throughput.py); the
  # SmolLM2 shape, then Llama-8B at 2,048 and 4,096, both teachers
  local t
  start_lane
  step smollm2-sf $PY $TT --shape smollm2 --teacher topk,hidden
  for t in 2048 4096; do
    step llama-sf-$t $PY $TT --shape llama8b --seq $t --teacher topk,hidden
  done
  [ -n "${SMI:-}" ] && kill "$SMI" 2>/dev/null
  mark lane
}

lane_g20() {  # the twentieth session: train's loader started before the model is set up (n),
  # meant against the tree before it (o), 200-step trains alternating after one cold extract;
  # then a 10-step train under cProfile (its setup and first step); the GPU tests last. As run
  # (b99a820), its o trains ran this tree too: `python -m` put the working directory ahead of
  # PYTHONPATH (tree_for now sets PYTHONSAFEPATH: python -P for a process and its children;
  # lane_h20 is the A/B)
  start_lane
  restore_answers
  old_tree
  trains_after_cold ld /tmp/inductor-g20 no_overrides tree_for p1:o1,n1,o2,n2,o3,n3,o4,n4,o5,n5
  TORCHINDUCTOR_CACHE_DIR=/tmp/inductor-g20 step prof-first $PY -m cProfile \
    -o "$RES/prof-first.out" -m drafter.cli train $CFG train.max_steps=10 train.eval_every=0 \
    --force
  pstats_text prof-first
  step gpu-tests $PY -m pytest -q -m gpu -p no:cacheprovider tests/test_train.py
  [ -n "${SMI:-}" ] && kill "$SMI" 2>/dev/null
  mark lane
}

lane_h20() {  # the twentieth session's second lane: the image's packages compiled to bytecode
  # first (bytecode_all: as pip does on install), then after one cold extract 200-step trains
  # alternating this tree (n) and the tree before it (o, old_tree), n first
  start_lane
  restore_answers
  old_tree
  bytecode_all
  trains_after_cold ab /tmp/inductor-h20 no_overrides tree_for p1:n1,o1,n2,o2,n3,o3,n4,o4
  [ -n "${SMI:-}" ] && kill "$SMI" 2>/dev/null
  mark lane
}

lane_i21() {  # not yet run (the twentieth session's device time ran out): the batch builders on
  # one intra-op thread each (88dd702 on, n) against the tree before it (o: .carry_d from
  # `git archive a084507 drafter | gzip`), ten 200-step trains after one cold extract
  start_lane
  restore_answers
  old_tree
  bytecode_all
  trains_after_cold io /tmp/inductor-i21 no_overrides tree_for p1:n1,o1,n2,o2,n3,o3,n4,o4,n5,o5
  [ -n "${SMI:-}" ] && kill "$SMI" 2>/dev/null
  mark lane
}

lane_j21() {  # the twenty-first session: the merge's Triton kernels (drafter/ttt.py) in
  # Inductor's Triton cache in every process (precompile.share_triton_cache, n) against the tree
  # before (o: .carry_d from `git archive 5fa95f6 drafter | gzip`, its extract's precompile child
  # included), whose first train after an extract took ~1 s longer (twentieth session): three
  # cold extracts, two 200-step trains after each, the tree before's first; Triton's own cache
  # emptied first; the GPU tests of tests/test_train.py (the merge's kernels where Inductor's are)
  start_lane
  restore_answers
  old_tree
  bytecode_all
  [ -z "${CHECK:-}" ] && rm -rf "$HOME/.triton/cache"
  trains_after_cold tc /tmp/inductor-j21 no_overrides tree_for op1:o1,o2 p2:n1,n2 p3:n3,n4
  step gpu-tests $PY -m pytest -q -m gpu -p no:cacheprovider tests/test_train.py
  [ -n "${SMI:-}" ] && kill "$SMI" 2>/dev/null
  mark lane
}

lane_k21() {  # the twenty-first session's second lane: the train a user's `drafter run` makes,
  # the first after a cold extract, five times on this tree (lane j21 had two)
  start_lane
  restore_answers
  bytecode_all
  trains_after_cold uc /tmp/inductor-k21 no_overrides this_tree p1:u1 p2:u2 p3:u3 p4:u4 p5:u5
  [ -n "${SMI:-}" ] && kill "$SMI" 2>/dev/null
  mark lane
}

triton_kernels() {  # triton_kernels IND WHEN: compiled Triton kernels in Inductor's cache IND and
  # in Triton's own (~/.triton/cache), the merge's (drafter/ttt.py: forward, backward) by name: the
  # first train after an extract took ~1 s longer (BENCHMARKS.md, twentieth session); if it
  # compiles the merge that the precompile process compiled elsewhere, these counts move
  [ -n "${CHECK:-}" ] && return
  local d n
  for d in "$1" "$HOME/.triton/cache"; do
    n=$(find "$d" -name '*.cubin' 2>/dev/null | wc -l)
    log "triton kernels $2: $n in $d, the merge's: $(find "$d" -name 'forward.json' \
      -o -name 'backward.json' 2>/dev/null | wc -l)"
  done
}

bytecode_all() {  # the image's site-packages compiled to bytecode under PYTHONPYCACHEPREFIX (the
  # image ships none: gpu_env.sh), as `pip install` leaves an ordinary install: otherwise the
  # first process to import a module pays its compile (a lane's first train after extract)
  local site
  site=$($PY -c 'import os, torch; print(os.path.dirname(os.path.dirname(torch.__file__)))')
  step bytecode-all timeout 120 $PY -m compileall -q -j 16 "$site"
  bytecode_state
}

old_tree() {  # the tree before a change, for A/B trains: .carry_d/old-drafter.tar.gz (here:
  # git archive REV drafter | gzip, REV as the lane says) unpacked into /tmp/old
  [ -n "${CHECK:-}" ] && return
  rm -rf /tmp/old && mkdir -p /tmp/old && tar -xzf .carry_d/old-drafter.tar.gz -C /tmp/old \
    && log "old tree: $(ls /tmp/old/drafter | wc -l) entries, $(env \
    PYTHONPATH="/tmp/old:$PYTHONPATH" $PY -P -c 'import drafter; print(drafter.__file__)')"
}

tree_for() {  # tree_for TRAIN: the drafter command for train TRAIN: o.. the old tree, else this
  # one (PYTHONSAFEPATH, python -P for its children too (extract's precompile): the working
  # directory, this tree, not ahead of PYTHONPATH)
  if [ "${1:0:1}" = o ]; then
    echo "env PYTHONSAFEPATH=1 PYTHONPATH=/tmp/old:$PYTHONPATH $PY -m drafter.cli"
  else
    echo "$DRAFTER"
  fi
}

bytecode_state() {  # whether this machine's processes write bytecode now, and how much there is
  [ -n "${CHECK:-}" ] && return
  log "bytecode: $($PY -c 'import os, sys; print("dont_write", sys.flags.dont_write_bytecode,
    "prefix", sys.pycache_prefix, "env", os.environ.get("PYTHONDONTWRITEBYTECODE"))'),\
 $(find /tmp/pycache -name '*.pyc' 2>/dev/null | wc -l) files under /tmp/pycache"
}

restore_answers() {  # pack_answers' answers, carried in .carry_c (BENCHMARKS.md: its own call)
  [ -n "${CHECK:-}" ] && return
  tar -xJf .carry_c/speed-answers.tar.xz && log "answers restored: $(ls runs/speed)"
}

pack_answers() {  # the real run's answers .. vocab, for a later machine of the session (under
  # 64 MiB, compressed): unpacked there by restore_answers, skipping the 2 min of answering
  [ -n "${CHECK:-}" ] && return
  tar -cJf "$OUT/speed-answers.tar.xz" --exclude=runs/speed/extract --exclude=runs/speed/train \
    --exclude=runs/speed/evaluate --exclude=runs/speed/export runs/speed
  log "answers packed: $(du -h "$OUT/speed-answers.tar.xz" | cut -f1)"
}

prof_precompile() {  # where a cold `drafter precompile` goes (its setup: 10-11 s), cProfile'd
  rm -rf /tmp/inductor-prof
  TORCHINDUCTOR_CACHE_DIR=/tmp/inductor-prof step prof-precompile $PY -m cProfile \
    -o "$RES/prof-precompile.out" -m drafter.cli precompile $CFG
  pstats_text prof-precompile
}

lane_short() {  # the sixteenth session's last device minutes, after a lost machine: the third
  # cold run with precompile, then the warm train under cProfile
  start_lane
  step speed-generate $DRAFTER run $CFG --until vocab
  cold pre-e true
  prof_warm_train
  [ -n "${SMI:-}" ] && kill "$SMI" 2>/dev/null
  mark lane
}

prof_warm_train() {  # where a warm warm-up goes: a 100-step train in the last cold run's
  # (pre-e's) warm cache, under cProfile
  TORCHINDUCTOR_CACHE_DIR=/tmp/inductor-pre-e step prof-warm-train $PY -m cProfile \
    -o "$RES/prof-warm-train.out" -m drafter.cli train $CFG train.max_steps=100 --force
  pstats_text prof-warm-train
}

pstats_text() {  # pstats_text NAME: $RES/NAME.out as text, by cumulative and by own time
  [ -n "${CHECK:-}" ] && return
  $PY -c "import pstats, sys
for key in ('cumulative', 'tottime'):
    print('=== sorted by', key)
    pstats.Stats(sys.argv[1], stream=sys.stdout).sort_stats(key).print_stats(120)" \
    "$RES/$1.out" > "$RES/$1.txt" 2>&1
}

keep_extract() {  # keep_extract TAG: the real run's extract manifest and precompile log
  cp runs/speed/extract/manifest.json "$RES/speed-$1.extract.manifest.json" 2>/dev/null
  cp runs/speed/extract/precompile.log "$RES/speed-$1.extract.precompile.log" 2>/dev/null
}

cold() {  # cold TAG PRECOMPILE: extract --force (precompile on or off), then train --force,
  # both in a fresh Inductor cache (its Triton kernels too), TORCH_TRACE'd apart
  local tag=$1 pre=$2 ind=/tmp/inductor-$1
  rm -rf "$ind"
  TORCHINDUCTOR_CACHE_DIR=$ind TORCH_TRACE="$RES/trace-$tag-extract" \
    step speed-$tag-extract $DRAFTER extract $CFG extract.precompile=$pre --force
  keep_extract "$tag"
  TORCHINDUCTOR_CACHE_DIR=$ind TORCH_TRACE="$RES/trace-$tag-train" \
    step speed-$tag-train $DRAFTER train $CFG extract.precompile=$pre --force
  keep_train "$tag"
  [ "$pre" = true ] && step cache-keys-$tag $PY benchmarks/cache_keys.py \
    "$RES/trace-$tag-extract" "$RES/trace-$tag-train"
  rm -rf "$RES/trace-$tag-extract" "$RES/trace-$tag-train"
}

lane_pre() {
  local v
  start_lane
  step gpu-tests $PY -m pytest -q -m gpu -p no:cacheprovider tests/test_model.py \
    tests/test_train.py
  step speed-generate $DRAFTER run $CFG --until vocab
  for v in a b; do
    cold "nopre-$v" false
    cold "pre-$v" true
  done
  beside_specforge
  [ -n "${SMI:-}" ] && kill "$SMI" 2>/dev/null
  mark lane
}

collect() {
  collect_runs
  log "collect: $(ls "$RES" | wc -l) files in results.tar.gz"
}

case "${1:-}" in
  start|start-*)  # start-NAME: lane_NAME as a daemon (setsid); start: lane
    fn=lane${1#start}; fn=${fn/-/_}
    setsid bash "$0" "$fn" < /dev/null > "$RES/lane.out" 2>&1 &
    sleep 2; log "$fn started" ;;
  lane|lane_*) "$1" ;;
  wait)
    end=$(( $(date +%s) + ${2:-500} ))
    while [ "$(date +%s)" -lt "$end" ] && [ ! -f "$RES/lane.done" ]; do sleep 5; done
    collect; tail -n 30 "$RES/phases.log"
    nvidia-smi --query-gpu=memory.used,utilization.gpu --format=csv,noheader ;;
  collect) collect ;;
  *) sed -n '2,/^set -uo/p' "$0" | sed '$d'; exit 2 ;;
esac
