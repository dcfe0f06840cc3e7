#!/usr/bin/env bash
# Session 4: host updates started per piece in backward (COMMIT): engine GPU tests, then
# full-3b auto (chunked loss, no clipping), FSDP2 beside it, lora-14b auto. Needs .whl.
set -u
source benchmarks/sessions/lib.sh
timeout 90 python3 -m pytest -q -p no:cacheprovider -m gpu tests/engine tests/plan \
  -k "not wrap_close_cycles" 2>&1 | tail -4 | tee "$OUT/gpu-tests.log"
R="python3 benchmarks/run.py --commit $C --run-id $RID --steps 5 --warmup 2 --max-grad-norm 0"
A="--system protrain --auto --chunked-loss-tokens 4096"
row 170 --workload full-3b $A --out "$OUT/auto.jsonl"
row 120 --workload full-3b --system fsdp2_offload --out "$OUT/auto.jsonl"
row 300 --workload lora-14b $A --out "$OUT/auto.jsonl"
echo "elapsed $((SECONDS - T0)) s"
