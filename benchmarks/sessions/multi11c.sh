#!/usr/bin/env bash
# Session 11, last call: full-8b at 24 GiB a GPU on two GPUs, batch 4 x 2048 a GPU, no
# clipping, in one run: FSDP2 CPU offload (the peer), ProTrain auto (the planner's plan,
# chunked loss 4,096), and ProTrain's FSDP2 engine with offload_params (issue 19).
source benchmarks/sessions/lib.sh
TWO="torchrun --nproc-per-node 2 benchmarks/run.py --commit $C --run-id $RID --steps 4 --warmup 2 --max-grad-norm 0"
nvidia-smi -L
R=$TWO
O="--workload full-8b --budget-gib 24 --out $OUT/multi-c.jsonl"
[ -z "$SKIP_PEER" ] && row 170 $O --system fsdp2_offload
row 170 $O $A  # SKIP_PEER=1: only the two ProTrain engines
row 170 $O --system protrain_fsdp2_offload --chunked-loss-tokens 4096
cp ~/.cache/protrain/hardware-*.json "$OUT/" 2>/dev/null; free -g | head -2
