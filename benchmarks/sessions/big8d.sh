#!/usr/bin/env bash
# Session 8, call 5, on the two-H200 host (one GPU used): full-8b's plan time with the arena
# touched once per page instead of zeroed in full (call 4: 31.5 s, 8.0 s of it mapping and
# touching the trace's 70 GB arena). Fewer measured steps: this call is for the plan time.
# Needs .whl and COMMIT.
set -u
source benchmarks/sessions/lib.sh
export CUDA_VISIBLE_DEVICES=0
timeout $(( $(left) - 10 )) python3 benchmarks/plan_accuracy.py --run-id "$RID" --steps 3 \
  --warmup 1 --out "$OUT/plan-accuracy.jsonl" --timeout-s 300 --only full-8b 2>&1 \
  | grep -v '^{' | tail -2
python3 - "$OUT/plan-accuracy.jsonl" <<'PY'
import json, sys
for l in open(sys.argv[1]):
    r = json.loads(l)
    print(r["config"], r["status"], "plan_s", r.get("plan_s"), "hw", r.get("hardware_s"), r.get("trace_phases_s"),
          r.get("trace_wrap_build_s"), "first step", r.get("time_to_first_step_s"), r.get("wrap_build_s"),
          "step", r.get("step_s"), "peak_err", r.get("peak_error"), "step_err", r.get("step_error"))
PY
echo "elapsed $((SECONDS - T0)) s"
