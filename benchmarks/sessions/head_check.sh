#!/usr/bin/env bash
# Session 5, call 1: the session-4 commits that ran only on the CPU, on the GPU (engine and
# plan GPU tests); full-3b in auto mode at HEAD with FSDP2 CPU offload beside it (the
# planner changed after the measured 9,979 tokens/s row); lora-14b's step timeline with its
# GPU-idle gaps explained. Chunked loss, no clipping. Needs .whl and COMMIT.
set -u
source benchmarks/sessions/lib.sh
timeout 90 python3 -m pytest -q -p no:cacheprovider -m gpu tests/engine tests/plan \
  -k "not wrap_close_cycles" 2>&1 | tail -4 | tee "$OUT/gpu-tests.log"
R="python3 benchmarks/run.py --commit $C --run-id $RID --steps 5 --warmup 2 --max-grad-norm 0"
A="--system protrain --auto --chunked-loss-tokens 4096"
row 170 --workload full-3b $A --out "$OUT/auto.jsonl"
row 120 --workload full-3b --system fsdp2_offload --out "$OUT/auto.jsonl"
T="python3 benchmarks/step_timeline.py --commit $C --steps 2 --warmup 2 --max-grad-norm 0"
timeout $(left) $T --workload lora-14b $A --bin-ms 10 --out "$OUT/timeline.jsonl" 2>&1 \
  | grep '^{\|Error' | cut -c1-4000
echo "elapsed $((SECONDS - T0)) s"
