# Shared by the GPU session scripts (h200_session.sh, recipe_session.sh, speed_session.sh),
# sourced from the repo root: where results go, the lanes' phase log and done-markers, the
# collection of every run's outputs, $PY and $DRAFTER (with benchmarks/gpu_env.sh sourced), and
# `step`, which runs one command of a lane (h200_session.sh has its own, with a GPU count).
#   RES  runs/gpu-out: every log, phases.log, NAME.done markers (collected into results.tar.gz)
#   OUT  $OUT on the device machine (what comes back), else runs/out
[ -n "${CHECK:-}" ] || source "$REPO/benchmarks/gpu_env.sh"   # CHECK=1: here, without a GPU
export DRAFTER_DEBUG=1   # an internal error's traceback goes into the run's log
PY=${PY:-python3}
DRAFTER="$PY -m drafter.cli"
RES=$REPO/runs/gpu-out
OUT=${OUT:-$REPO/runs/out}
mkdir -p "$OUT" "$RES" "$REPO/runs"
log() { echo "[$(date +%H:%M:%S)] $*" | tee -a "$RES/phases.log"; }
mark() { touch "$RES/$1.done"; }
await() { [ -n "${CHECK:-}" ] && return; while [ ! -f "$RES/$1.done" ]; do sleep 2; done; }
collect_runs() {  # every run dir's status and outputs into RES, RES into $OUT/results.tar.gz
  local d f name
  for d in runs/*/; do
    name=$(basename "$d")
    [ -f "$d/config.yaml" ] || continue
    [ -n "${CHECK:-}" ] || $DRAFTER status "$d" --json > "$RES/$name.status.json" 2>/dev/null
    for f in evaluate/metrics.json evaluate/report.md evaluate/acceptance.png \
             train/metrics.jsonl generate/manifest.json tokenize/manifest.json \
             vocab/manifest.json train/manifest.json; do
      [ -f "$d/$f" ] && cp "$d/$f" "$RES/$name.$(dirname "$f").$(basename "$f")"
    done
  done
  tar -czf "$OUT/results.tar.gz" -C "$RES" .
  cp "$RES/phases.log" "$OUT/phases.log" 2>/dev/null
}
step() {  # step NAME CMD...: run, log to $RES/NAME.log, never stop the lane (recipe_session.sh,
  # speed_session.sh; CHECK=1: a drafter command's config is resolved, nothing else runs)
  local name=$1; shift
  log "$name: start"
  if [ -n "${CHECK:-}" ]; then  # drafter commands: the config resolved only; the rest skipped
    [[ " $* " == *" drafter.cli "* ]] || { log "$name: skipped"; return; }
    local args=() prev="" a
    for a in "$@"; do
      [ "$prev" = --until ] && { prev=$a; continue; }
      prev=$a
      case "$a" in --force|--until) continue ;; esac
      [ "${args[*]: -1}" = drafter.cli ] && a=config
      args+=("$a")
    done
    "${args[@]}" > /dev/null 2>> "$RES/$name.log"
  else
    "$@" >> "$RES/$name.log" 2>&1
  fi
  log "$name: exit $?"
}
