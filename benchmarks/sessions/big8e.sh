#!/usr/bin/env bash
# Session 8, call 6, on the two-H200 host (one GPU used): full-8b planned twice in one
# process (--plan-repeats 2): the first trace runs on a freshly started host whose memory
# was never touched, the second on memory the first one already used. One measured step.
# Needs .whl and COMMIT.
set -u
source benchmarks/sessions/lib.sh
export CUDA_VISIBLE_DEVICES=0
timeout $(( $(left) - 10 )) python3 benchmarks/plan_accuracy.py --run-id "$RID" --steps 1 \
  --warmup 0 --plan-repeats 2 --out "$OUT/plan-accuracy.jsonl" --timeout-s 300 --only full-8b \
  2>&1 | grep -v '^{' | tail -2
python3 - "$OUT/plan-accuracy.jsonl" <<'PY'
import json, sys
for l in open(sys.argv[1]):
    r = json.loads(l)
    print(r["config"], r["status"], "plan_s", r.get("plan_s"), r.get("trace_phases_s"), r.get("trace_wrap_build_s"))
    for x in r.get("plan_repeats", []):
        print("again", x)
PY
echo "elapsed $((SECONDS - T0)) s"
