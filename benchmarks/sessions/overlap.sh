#!/usr/bin/env bash
# Session 3, GPU call 1 (one H200): the host worker's forward-order ranking and piecewise
# gathers of updating chunks. full-3b at 24 GiB: hand knobs with and without clipping,
# auto mode without clipping, and FSDP2 CPU offload without clipping in the same run (for
# a ratio within one run); then the engine GPU tests. Needs .whl carried. Results in $OUT.
set -u
LIMIT=${LIMIT:-575}
source benchmarks/sessions/lib.sh
R="python3 benchmarks/run.py --commit $C --run-id $RID --steps 5 --warmup 2 --workload full-3b --out $OUT/full3b.jsonl"
K="--system protrain --n-persist 1 --n-buffer 3 --chunk-mib 769"
row 90 $K --max-grad-norm 0
row 90 $K
row 120 --system protrain --auto --max-grad-norm 0
row 150 --system fsdp2_offload --max-grad-norm 0
l=$(left); [ "$l" -gt 40 ] && timeout $((l - 5)) python3 -m pytest -q -p no:cacheprovider -m gpu \
  tests/engine -k "not wrap_close_cycles" 2>&1 | tail -12 | tee $OUT/engine-gpu-tests.log
echo "elapsed $((SECONDS - T0)) s"
