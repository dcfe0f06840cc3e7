#!/usr/bin/env bash
# Session 7, last call: full-3b (24 GiB, no clipping) with DeepSpeed ZeRO-3 offload and
# ProTrain in auto mode in one run, for the ratio the issue asks (2.5x); FSDP2 beside ProTrain
# ran in call D on another H100. Needs .whl (with the DeepSpeed source) and COMMIT.
set -u
source benchmarks/sessions/lib.sh
python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-cache-dir --upgrade \
  --target /tmp/site .whl/deepspeed-0.19.8.tar.gz 2>&1 | tail -2
row 250 --workload full-3b --system ds_z3_offload --out "$OUT/auto.jsonl"
row 160 --workload full-3b $A --out "$OUT/auto.jsonl"
echo "elapsed $((SECONDS - T0)) s"
