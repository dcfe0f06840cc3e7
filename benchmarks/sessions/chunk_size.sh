#!/usr/bin/env bash
# Session 4: does a smaller chunk speed up full-3b (24 GiB, auto, chunked loss, no clipping)?
# 5 chunks of 1268 MiB by default (the tied embedding, 752 MiB, sets the floor): the host
# AdamW of a chunk starts only when all of its gradients have landed and the next forward
# waits for a whole chunk's update. Auto mode plans each chunk size itself. Needs .whl.
set -u
source benchmarks/sessions/lib.sh
R="python3 benchmarks/run.py --commit $C --run-id $RID --steps 5 --warmup 2 --max-grad-norm 0"
for mib in ${CHUNKS:-default 760 1000}; do
  extra=(); [ "$mib" = default ] || extra=(--chunk-mib "$mib")
  row 170 --workload full-3b --system protrain --auto --chunked-loss-tokens 4096 "${extra[@]}" \
    --out "$OUT/chunk-size.jsonl"
done
echo "elapsed $((SECONDS - T0)) s"
# FSDP2 CPU offload beside them, same machine, no clipping either (the anchor is 4,599).
row 200 --workload full-3b --system fsdp2_offload --out "$OUT/chunk-size.jsonl"
echo "elapsed $((SECONDS - T0)) s"
