# Shared by the GPU session scripts (h200_session.sh, recipe_session.sh), sourced from the repo
# root: where results go, the lanes' phase log and done-markers, and the collection of every
# run's outputs (collect_runs calls $DRAFTER, which the script sets).
#   RES  runs/gpu-out: every log, phases.log, NAME.done markers (collected into results.tar.gz)
#   OUT  $OUT on the device machine (what comes back), else runs/out
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
