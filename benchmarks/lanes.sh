# Shared by the GPU session scripts (h200_session.sh, recipe_session.sh), sourced from the repo
# root: where results go, and the lanes' phase log and done-markers.
#   RES  runs/gpu-out: every log, phases.log, NAME.done markers (collected into results.tar.gz)
#   OUT  $OUT on the device machine (what comes back), else runs/out
RES=$REPO/runs/gpu-out
OUT=${OUT:-$REPO/runs/out}
mkdir -p "$OUT" "$RES" "$REPO/runs"
log() { echo "[$(date +%H:%M:%S)] $*" | tee -a "$RES/phases.log"; }
mark() { touch "$RES/$1.done"; }
await() { while [ ! -f "$RES/$1.done" ]; do sleep 2; done; }
