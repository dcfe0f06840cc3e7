#!/usr/bin/env bash
# Session 11: the planner on two GPUs (nvidia-h100-x2 / nvidia-h200-x2), no clipping, auto
# mode as the app runs it (chunked loss 4,096), each rank capped at the budget; rows record
# the plan's mode, its predicted and measured peak (largest over ranks, after the trace).
# PART=a: auto full-3b at 24 and 16 GiB, full-3b at 24 GiB replicated, full-8b at 24 GiB;
#         DeepSpeed ZeRO-3 offload on full-8b at 24 GiB beside them.
# PART=b: auto full-3b at 16 GiB again (the row now carries the plan's reasons), lora-14b at
#         24 GiB, qlora-70b (chunked loss 2,048) at 24 GiB.
source benchmarks/sessions/lib.sh
TWO="torchrun --nproc-per-node 2 benchmarks/run.py --commit $C --run-id $RID --steps 4 --warmup 2 --max-grad-norm 0"
nvidia-smi -L
R=$TWO
case "${PART:-a}" in
a)
  O="--out $OUT/auto2-a.jsonl"
  row 150 --workload full-3b $A --budget-gib 24 $O
  row 110 --workload full-3b $A --budget-gib 16 $O
  row 110 --workload full-3b $A --budget-gib 24 --distributed-mode replicated $O
  row 170 --workload full-8b $A --budget-gib 24 $O
  python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-cache-dir --upgrade \
    --target /tmp/site .whl/deepspeed-0.19.8.tar.gz >/dev/null 2>&1
  row 200 --workload full-8b --budget-gib 24 --system ds_z3_offload $O
  ;;
b)
  O="--out $OUT/auto2-b.jsonl"
  row 110 --workload full-3b $A --budget-gib 16 $O
  row 170 --workload lora-14b $A --budget-gib 24 $O
  row 260 --workload qlora-70b --system protrain --auto --chunked-loss-tokens 2048 --budget-gib 24 $O
  ;;
esac
cp ~/.cache/protrain/hardware-*.json "$OUT/" 2>/dev/null; free -g | head -2
