#!/usr/bin/env bash
# Session 4: where the step time goes (benchmarks/step_timeline.py) for full-3b and lora-14b
# in auto mode (chunked loss, no clipping, the chunk size searched). Needs .whl.
set -u
source benchmarks/sessions/lib.sh
T="python3 benchmarks/step_timeline.py --commit $C --steps 2 --warmup 2 --max-grad-norm 0"
A="--system protrain --auto --chunked-loss-tokens 4096"
timeout 200 $T --workload full-3b $A --bin-ms 5 --trace "$OUT/full3b-trace.json.gz" \
  --out "$OUT/timeline.jsonl" 2>&1 | grep '^{\|Error' | cut -c1-3000
timeout $(left) $T --workload lora-14b $A --bin-ms 10 --out "$OUT/timeline.jsonl" 2>&1 \
  | grep '^{\|Error' | cut -c1-3000
ls -la "$OUT"; echo "elapsed $((SECONDS - T0)) s"
