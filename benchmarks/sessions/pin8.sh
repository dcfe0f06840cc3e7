#!/usr/bin/env bash
# Session 8, call 1 (H100): where a large model's plan time goes. Host pinning rates (each
# way of getting 16 GiB of pinned memory, and the copies the wrap makes), then full-3b as a
# plan-accuracy row, whose trace now splits the wrap into pinning and copying in.
# Needs .whl and COMMIT.
set -u
source benchmarks/sessions/lib.sh
free -g | head -2
timeout 150 python3 benchmarks/host_pinning.py --gib 16 --out "$OUT/host-pinning.jsonl" 2>&1 | tail -12
timeout $(( $(left) - 10 )) python3 benchmarks/plan_accuracy.py --run-id "$RID" \
  --out "$OUT/plan-accuracy.jsonl" --timeout-s 300 --only full-3b 2>&1 | grep -v '^{' | tail -3
python3 - "$OUT/plan-accuracy.jsonl" <<'PY'
import json, sys
for l in open(sys.argv[1]):
    r = json.loads(l)
    print(r["config"], r.get("plan_s"), r.get("trace_phases_s"), r.get("time_to_first_step_s"), r.get("step_s"))
PY
echo "elapsed $((SECONDS - T0)) s"
