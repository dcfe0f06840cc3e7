#!/usr/bin/env bash
# Session 7, call 1: why the host AdamW runs slower in plans that swap (session 6: 16 GiB
# full fine-tuning rows, 1.7x the predicted host step). Each 16 GiB row runs its chosen plan
# and, on the same trace, swap and no-swap alternatives at equal n_persist, the swap one also
# with fewer host threads (CPU oversubscription?). Then the search on qlora-70b's kept profile
# (CPU speed of this host against the 2-core dev machine). Needs .whl and COMMIT.
set -u
source benchmarks/sessions/lib.sh
lscpu | grep -E '^(CPU\(s\)|Thread|Core|Socket|Model name|NUMA node\(s\))' 
PA="python3 benchmarks/plan_accuracy.py --steps 4 --warmup 2 --run-id $RID --out $OUT/plan-accuracy.jsonl"
timeout 200 $PA --only extra-3b-full-16-b1-s2048 --timeout-s 195 \
  --also "1,2,8,16;1,2,8,16,10;1,2,0,24;0,2,0,6;0,2,0,6,10" 2>&1 | grep -v '^{' | tail -2
timeout 150 $PA --only extra-1b-full-16-b2-s1024 --timeout-s 145 \
  --also "3,2,13,0;3,2,13,0,10;2,2,0,11;2,2,0,11,10" 2>&1 | grep -v '^{' | tail -2
mkdir -p /tmp/dprof && tar xzf benchmarks/results/2026-11-22-session6-D-profiles.tgz -C /tmp/dprof
timeout 60 python3 benchmarks/search_time.py --profile /tmp/dprof/profiles/qlora-70b.profile.json.gz \
  --hardware /tmp/dprof/profiles/qlora-70b.hardware.json --shape llama70b --lora-rank 16 \
  --budget-gib 24 --out "$OUT/search-time.jsonl" 2>&1 | grep '^{' | cut -c1-400
echo "elapsed $((SECONDS - T0)) s"
