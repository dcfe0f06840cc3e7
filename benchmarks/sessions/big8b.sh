#!/usr/bin/env bash
# Session 8, call 3, on the two-H200 host (one GPU used): call 2's full-8b ran its host
# AdamW 25% slower than session 7's and pinned at 4 GiB/s, not the 14 GiB/s of 16 GiB alone.
# A/B of the host arena through the engine: full-8b and full-3b, each with the engine's
# huge-page arena and with the plain one of session 7 (--host-arena plain). The trace now
# gives the host weights back without copies, and times the arena's allocation and pinning
# apart. Needs .whl and COMMIT.
set -u
source benchmarks/sessions/lib.sh
export CUDA_VISIBLE_DEVICES=0
grep -E 'AnonHugePages|HugePages_Total|MemFree' /proc/meminfo; lscpu | grep -E 'NUMA|Socket'
PA="python3 benchmarks/plan_accuracy.py --run-id $RID --out $OUT/plan-accuracy.jsonl --timeout-s 300"
for cfg in full-8b full-3b; do
  for arena in huge plain; do
    [ "$(left)" -lt 60 ] && { echo "skipped $cfg $arena"; continue; }
    timeout $(( $(left) - 10 )) $PA --only $cfg --host-arena $arena 2>&1 | grep -v '^{' | tail -1
    grep AnonHugePages /proc/meminfo
  done
done
python3 - "$OUT/plan-accuracy.jsonl" <<'PY'
import json, sys
for l in open(sys.argv[1]):
    r = json.loads(l)
    print(r["config"], r["host_arena"], r["status"], "plan_s", r.get("plan_s"), r.get("trace_phases_s"),
          r.get("trace_wrap_build_s"), "first step", r.get("time_to_first_step_s"), r.get("wrap_build_s"),
          "step", r.get("step_s"), r.get("engine_stats_per_step"), "peak_err", r.get("peak_error"),
          "step_err", r.get("step_error"))
PY
echo "elapsed $((SECONDS - T0)) s"
