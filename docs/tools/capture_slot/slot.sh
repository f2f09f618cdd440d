#!/bin/bash
# The quiet slot of 2026-12-02 19:50-20:06 UTC (docs/serve.md, "Measured in the quiet slot"):
# rounds of three interleaved `rt bench serve` runs at 200 streams, the order rotated each
# round: lean; capture; capture with the engine at --engine-nice -10 and the API process's
# threads reniced to -10 from outside once it is up (renice_api; -10 needs root). Then 1-token
# runs. Each run's report in $OUT/NAME.json and records in $OUT/NAME.pkl (bench_dump.py), the
# load average at each start and end in $OUT/log. A measuring aid, not part of rt.
#   docs/tools/capture_slot/slot.sh CHECKOUT OUT ROUNDS_UNTIL_HHMMSS
set -u
CHECKOUT=$1 OUT=$2 UNTIL=${3:-200430}
TOOLS=$(cd "$(dirname "$0")" && pwd)
cd "$CHECKOUT" || exit 2
export OMP_NUM_THREADS=1 PYTHONPATH=$CHECKOUT
PY=/work/main/.venv/bin/python
mkdir -p "$OUT"
renice_api() { # every thread of the newest `rt serve --simulate` process, once it is up
  for _ in $(seq 100); do
    pid=$(pgrep -n -f "cli serve --simulate" || true)
    if [ -n "$pid" ]; then
      sleep 1
      for task in /proc/$pid/task/*; do renice -n -10 -p "${task##*/}" >/dev/null; done
      echo "reniced $pid to $(ps -o ni= -p "$pid")" >> "$OUT/log"
      return
    fi
    sleep 0.1
  done
}
run() { # NAME CLIENT [rt bench serve flags...]
  local name=$1 client=$2; shift 2
  echo "$(date -u +%T) start $name load $(cut -d' ' -f1-3 /proc/loadavg)" >> "$OUT/log"
  DUMP=$OUT/$name.pkl $PY "$TOOLS/bench_dump.py" bench serve --client "$client" \
    --concurrency 200 "$@" -o "$OUT/$name.json" > /dev/null 2> "$OUT/$name.err"
  echo "$(date -u +%T) end $name rc $? load $(cut -d' ' -f1-3 /proc/loadavg)" >> "$OUT/log"
}
nicerun() { renice_api & run "$@" --engine-nice -10; wait; }
lean() { run "lean.$1" lean --num-prompts 1000; }
capture() { run "capture.$1" capture --num-prompts 1000; }
nice10() { nicerun "nice.$1" capture --num-prompts 1000; }
i=1
while [ "$(date -u +%H%M%S)" -lt "$UNTIL" ]; do
  case $((i % 3)) in
    1) lean $i; capture $i; nice10 $i ;;
    2) capture $i; nice10 $i; lean $i ;;
    0) nice10 $i; lean $i; capture $i ;;
  esac
  i=$((i + 1))
done
for j in 1 2; do
  run "lean1tok.$j" lean --num-prompts 4000 --random-output-len 1
  run "capture1tok.$j" capture --num-prompts 4000 --random-output-len 1
done
echo "$(date -u +%T) done" >> "$OUT/log"
