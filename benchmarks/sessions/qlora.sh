#!/usr/bin/env bash
# Session 5, call 2: QLoRA inside chunks on the GPU (its GPU test), the qlora-70b row in
# auto mode (4-bit NF4 base of the Llama-3-70B shape, 24 GiB), then lora-14b's timeline
# with the loss chunked by 1,024 tokens instead of 4,096 (call 1 saw a 209 ms host stall in
# the output layer's matmul at the loss: an allocator flush at the budget?). No clipping.
# Needs .whl (bitsandbytes included) and COMMIT.
set -u
source benchmarks/sessions/lib.sh
timeout 90 python3 -m pytest -q -p no:cacheprovider -m gpu tests/engine/test_qlora.py 2>&1 \
  | tail -4 | tee "$OUT/qlora-gpu-tests.log"
R="python3 benchmarks/run.py --commit $C --run-id $RID --steps 3 --warmup 2 --max-grad-norm 0"
row 330 --workload qlora-70b --system protrain --auto --chunked-loss-tokens 2048 \
  --out "$OUT/qlora.jsonl"
T="python3 benchmarks/step_timeline.py --commit $C --steps 2 --warmup 2 --max-grad-norm 0"
timeout $(left) $T --workload lora-14b --system protrain --auto --chunked-loss-tokens 1024 \
  --bin-ms 10 --out "$OUT/timeline.jsonl" 2>&1 | grep '^{\|Error' | cut -c1-4000
echo "elapsed $((SECONDS - T0)) s"
