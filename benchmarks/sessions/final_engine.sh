#!/usr/bin/env bash
# Session 3, GPU call 6 (one H200): after the review fixes (e03b904: the host worker picks
# the most urgent *ready* update, per-update progress, exit handling): the engine GPU
# tests, then full-3b auto (chunked loss, no clipping) as in call 4. Needs .whl.
set -u
LIMIT=${LIMIT:-230}
source benchmarks/sessions/lib.sh
timeout 60 python3 -m pytest -q -p no:cacheprovider -m gpu tests/engine -k "not wrap_close_cycles" \
  2>&1 | tail -4 | tee $OUT/engine-gpu-tests.log
R="python3 benchmarks/run.py --commit $C --run-id $RID --steps 5 --warmup 2 --max-grad-norm 0"
row 150 --workload full-3b --system protrain --auto --chunked-loss-tokens 4096 --out $OUT/auto.jsonl
echo "elapsed $((SECONDS - T0)) s"
