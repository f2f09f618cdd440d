#!/usr/bin/env bash
# Measure `rt fidelity --endpoint` against a live `vllm serve` of the tiny Llama, or against
# `rt serve --model` with the same model (issue #20; docs/calibration.md, "Fidelity against an
# endpoint"). Starts the server in its own session, waits until it answers, runs
#   rt fidelity TRACE --endpoint URL [the server's flags] --repeats $REPEATS --no-plots
# with the load average (1 min) and the time before and after, prints the per-window view of
# every replay (docs/measure/endpoint_windows.py), and stops the server (its whole session).
#
#   W=/work/wt-vllm20 OUT=/tmp/vf SERVER=vllm NAME=vllm-1 bash docs/measure/vllm_fidelity.sh
#   W=/work/wt-vllm20 OUT=/tmp/vf SERVER=rt NAME=rt-1 bash docs/measure/vllm_fidelity.sh
#   W=/work/wt-vllm20 OUT=/tmp/vf SERVER=running PORT=18341 NAME=x bash docs/measure/vllm_fidelity.sh
#
# SERVER=running measures a server already answering on PORT (started beforehand, so that a
# quiet slot is spent on replays, not on start-up) and leaves it running.
# SERVER=vllm runs vLLM 0.32 for CPU from $VLLM_VENV (../shared/tools/vllm_serve/README.md)
# with VLLM_CPU_KVCACHE_SPACE=1 and the environment in $VLLM_ENV (space-separated NAME=VALUE;
# default: VLLM_ENABLE_V1_MULTIPROCESSING=0, the worker inside the engine-core process, so that
# nothing busy-waits: calibration.md, "vLLM's stall windows"); VLLM_ENV= (empty)
# runs it as it comes. One run is ~40 s of start-up and ~2-3 min of replays and fitting.
set -euo pipefail
W=${W:-$PWD}
OUT=${OUT:-/tmp/vllm-fidelity}
SERVER=${SERVER:-vllm}
NAME=${NAME:-$SERVER}
REPEATS=${REPEATS:-2}
VLLM_VENV=${VLLM_VENV:-/tmp/vllm-venv}
VLLM_ENV=${VLLM_ENV-VLLM_ENABLE_V1_MULTIPROCESSING=0}
MODEL=${MODEL:-$HOME/.cache/rt/tiny-llama-v2}
PY=${PY:-/work/main/.venv/bin/python}
PORT=${PORT:-18341}
FLAGS=(--max-num-batched-tokens 2048 --max-num-seqs 128)  # the CPU defaults vLLM logs
mkdir -p "$OUT"
rt() { (cd "$W" && OMP_NUM_THREADS=1 PYTHONPATH="$W" "$PY" -c 'from cli import main; main()' "$@"); }
TRACE="$OUT/t.jsonl"  # 100 requests, 128-384 prompt / 16-48 output tokens, 8 req/s
[ -f "$TRACE" ] || rt trace gen -o "$TRACE" --num-prompts 100 --random-input-len 256 \
  --random-output-len 32 --random-range-ratio 0.5 --request-rate 8 --seed 1
SID=
if [ "$SERVER" = running ]; then
  :
elif [ "$SERVER" = vllm ]; then
  # shellcheck disable=SC2086
  setsid env HF_HUB_OFFLINE=1 VLLM_CPU_KVCACHE_SPACE=1 OMP_NUM_THREADS=1 $VLLM_ENV \
    "$VLLM_VENV/bin/python" "$W/../shared/tools/vllm_serve/vllm" serve "$MODEL" \
    --host 127.0.0.1 --port "$PORT" --max-model-len 2048 --dtype float32 \
    > "$OUT/$NAME.server.log" 2>&1 &
else
  (cd "$W" && exec setsid env OMP_NUM_THREADS=1 PYTHONPATH="$W" "$PY" -c \
    'from cli import main; main()' serve --model "$MODEL" --port "$PORT" "${FLAGS[@]}" \
    > "$OUT/$NAME.server.log" 2>&1) &
fi
[ "$SERVER" = running ] || SID=$!
stop() {
  [ -n "$SID" ] || return 0
  kill -TERM -- "-$SID" 2>/dev/null || true; sleep 3; kill -KILL -- "-$SID" 2>/dev/null || true
}
trap stop EXIT
for _ in $(seq 120); do
  curl -sf "http://127.0.0.1:$PORT/v1/models" > /dev/null && break
  sleep 1
done
curl -sf "http://127.0.0.1:$PORT/v1/models" > /dev/null || { echo "server did not start" >&2; exit 1; }
ENV_NOTE=; [ "$SERVER" = vllm ] && ENV_NOTE=" env: ${VLLM_ENV:-none}"
echo "$NAME: start $(date -u +%T) load $(cut -d' ' -f1-3 /proc/loadavg)$ENV_NOTE" \
  | tee "$OUT/$NAME.load"
rt fidelity "$TRACE" --endpoint "http://127.0.0.1:$PORT" --vocab-size 512 "${FLAGS[@]}" \
  --timeout 60 --repeats "$REPEATS" --no-plots --result-dir "$OUT/$NAME" \
  > "$OUT/$NAME.log" 2>&1 || echo "rt fidelity exited $? (see $OUT/$NAME.log)"
echo "$NAME: end $(date -u +%T) load $(cut -d' ' -f1-3 /proc/loadavg)" | tee -a "$OUT/$NAME.load"
"$PY" "$W/docs/measure/endpoint_windows.py" "$OUT/$NAME" | tee "$OUT/$NAME.windows"
tail -25 "$OUT/$NAME.log"
