#!/usr/bin/env bash
# Measure `rt fidelity --fleet` (issue #15; docs/route.md): two commits of rt, each run from
# a `git archive` of its own (so the worktree can change meanwhile), alternating per router
# base, new, new, base in odd rounds and new, base, base, new in even ones (a drift of the
# machine falls on both alike); the load average (1 min) before and after each run and the
# time are kept beside each run. Then `python docs/measure/fleet_fidelity_rows.py OUT`
# prints one markdown row per run (as docs/route.md's tables).
#
#   REPO=/work/wt-fid15 NEW_REV=HEAD BASE_REV=8699b30 OUT=/tmp/fleet-fid ROUNDS=2 \
#       bash docs/measure/fleet_fidelity.sh
#
# One run is about 65-75 s of wall time and 30 s of CPU on the 2-vCPU machine (4 replicas
# of rt serve --simulate, the router, the client); a round (2 routers x 4 runs) about 10 min.
set -euo pipefail
REPO=${REPO:-$PWD}
NEW_REV=${NEW_REV:-HEAD}
BASE_REV=${BASE_REV:-8699b30}
OUT=${OUT:-/tmp/fleet-fidelity}
ROUNDS=${ROUNDS:-2}
FIRST_ROUND=${FIRST_ROUND:-1}  # to add rounds to an OUT that has some
ROUTERS=${ROUTERS:-"prefix-aware round-robin"}
PY=${PY:-/work/main/.venv/bin/python}
mkdir -p "$OUT"
for side in new base; do
  rev=$NEW_REV; [ "$side" = base ] && rev=$BASE_REV
  if [ ! -d "$OUT/$side-src" ]; then
    mkdir -p "$OUT/$side-src"
    git -C "$REPO" archive "$rev" | tar -x -C "$OUT/$side-src"
    git -C "$REPO" rev-parse --short "$rev" > "$OUT/$side-src/REV"
  fi
done
rt() {  # rt from checkout $1 (PYTHONPATH wins over the shared venv's editable install)
  local src=$1; shift
  (cd "$src" && OMP_NUM_THREADS=1 PYTHONPATH="$src" "$PY" -c 'from cli import main; main()' "$@")
}
TRACE="$OUT/mt160.jsonl"
[ -f "$TRACE" ] || rt "$OUT/new-src" trace gen --dataset-name multi_turn --num-prompts 160 \
  --random-input-len 384 --random-output-len 32 --random-range-ratio 0.5 \
  --multi-turn-num-turns 4 --multi-turn-gap-s 4 --request-rate 4 --seed 1 -o "$TRACE"
run() {  # side router tag
  local dest="$OUT/$2-$1-$3" before
  before=$(cut -d' ' -f1 /proc/loadavg)
  rt "$OUT/$1-src" fidelity "$TRACE" --fleet --replicas 4 --router "$2" \
    --max-model-len 8192 --result-dir "$dest" > "$dest.log" 2>&1 || echo "failed: $dest" >&2
  echo "$before $(cut -d' ' -f1 /proc/loadavg) $(date -u +%H:%M:%S)" > "$dest.load"
  echo "$dest $(cat "$dest.load")"
}
for round in $(seq "$FIRST_ROUND" $((FIRST_ROUND + ROUNDS - 1))); do
  order="base new new base"; [ $((round % 2)) = 0 ] && order="new base base new"
  for router in $ROUTERS; do
    declare -A seen=([base]=0 [new]=0)
    for side in $order; do
      seen[$side]=$((seen[$side] + 1))
      run "$side" "$router" "$round.${seen[$side]}"
    done
  done
done
