#!/usr/bin/env bash
# Session 7, on the two-H200 host (256 GiB of host memory; the one-GPU hosts' 125 GiB is too
# little for 8B full fine-tuning's host states): the matrix's full-8b as a plan-accuracy row
# (one GPU, 80 GiB budget, clipping 1.0), then extra-8b-full-40-b1-s2048 if time is left.
# Needs .whl and COMMIT.
set -u
source benchmarks/sessions/lib.sh
export CUDA_VISIBLE_DEVICES=0
free -g | head -2
timeout $(( $(left) - 10 )) python3 benchmarks/plan_accuracy.py --run-id "$RID" \
  --out "$OUT/plan-accuracy.jsonl" --profiles "$OUT/profiles" --profile-search \
  --timeout-s 300 --only full-8b,extra-8b-full-40-b1-s2048 2>&1 | grep -v '^{' \
  | grep -i 'configurations ran\|peak error\|Error' | tail -6
[ -d "$OUT/profiles" ] && tar -czf "$OUT/profiles.tgz" -C "$OUT" profiles && rm -rf "$OUT/profiles"
echo "elapsed $((SECONDS - T0)) s"
