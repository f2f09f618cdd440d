#!/usr/bin/env bash
# Records check: the same 15 simulations run by the code in DIR, written under OUT.
# Compare two OUTs with cmp.py (every parquet file DataFrame.equals); a change to the
# simulator or the core must leave them ALL EQUAL unless it means to change records.
#   bash docs/tools/records_check/records.sh DIR OUT   (DIR: a checkout or a `git archive`)
set -euo pipefail
DIR=$(cd "$1" && pwd); OUT=$2; T=${TRACES:-/work/shared/traces}
mkdir -p "$OUT"; OUT=$(cd "$OUT" && pwd)
PY=${PY:-python}
run() { name=$1; shift
  (cd "$DIR" && OMP_NUM_THREADS=1 PYTHONPATH="$DIR" "$PY" cli.py simulate --result-dir "$OUT/$name" "$@" >"$OUT/$name.log" 2>&1) \
    || { echo "FAILED: $name (see $OUT/$name.log)"; exit 1; }
}
run default
run rr4 --replicas 4 --router round-robin
run dynamo4 --replicas 4 --router dynamo-kv --time-scale 0.25
run preempt --time-scale 0.1 --num-gpu-blocks-override 1500
run azure --trace "$T/azure_conv_2023_head.csv"
run lor16 --replicas 16 --router least-outstanding --time-scale 0.0625
run p2c8x2 --replicas 8 --routers 2 --router power-of-two --time-scale 0.125
run mooncake --trace "$T/mooncake_conversation_head.jsonl" --first-n 1500
run sharegpt --trace "$T/sharegpt_lengths.csv" --first-n 3000 --num-gpu-blocks-override 4000 --no-enable-prefix-caching
run mooncake_dynamo4 --trace "$T/mooncake_conversation_head.jsonl" --first-n 800 --replicas 4 --router dynamo-kv
run mooncake_priority --trace "$T/mooncake_conversation_head.jsonl" --first-n 1500 --num-gpu-blocks-override 3000 --policy priority
run mooncake_sglang8 --trace "$T/mooncake_conversation_head.jsonl" --first-n 800 --replicas 8 --router sglang-cache-aware \
  --router-arg max_tree_size=20000 --router-arg eviction_interval_s=5
run mooncake_prefix4 --trace "$T/mooncake_conversation_head.jsonl" --first-n 800 --replicas 4 --router prefix-aware
run sglang16 --replicas 16 --router sglang-cache-aware --time-scale 0.0625
run mooncake_llmd4 --trace "$T/mooncake_conversation_head.jsonl" --first-n 800 --replicas 4 --router llm-d --router-arg auto_tune=false --router-arg lru_capacity_per_server=3000
echo "15 runs written under $OUT"
