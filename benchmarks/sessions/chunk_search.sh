#!/usr/bin/env bash
# Session 4: auto mode with the chunk size searched (f-commit in COMMIT): the engine GPU
# tests, full-3b and FSDP2 beside it, then lora-14b (chunked loss, no clipping). Needs .whl.
set -u
source benchmarks/sessions/lib.sh
full3b_beside_fsdp2
row 330 --workload lora-14b $A --out "$OUT/auto.jsonl"
echo "elapsed $((SECONDS - T0)) s"
