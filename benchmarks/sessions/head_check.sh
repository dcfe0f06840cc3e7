#!/usr/bin/env bash
# Session 5, call 1: the session-4 commits that ran only on the CPU, on the GPU (engine and
# plan GPU tests); full-3b in auto mode at HEAD with FSDP2 CPU offload beside it (the
# planner changed after the measured 9,979 tokens/s row); lora-14b's step timeline with its
# GPU-idle gaps explained. Chunked loss, no clipping. Needs .whl and COMMIT.
set -u
source benchmarks/sessions/lib.sh
full3b_beside_fsdp2
T="python3 benchmarks/step_timeline.py --commit $C --steps 2 --warmup 2 --max-grad-norm 0"
timeout $(left) $T --workload lora-14b $A --bin-ms 10 --out "$OUT/timeline.jsonl" 2>&1 \
  | grep '^{\|Error' | cut -c1-4000
echo "elapsed $((SECONDS - T0)) s"
