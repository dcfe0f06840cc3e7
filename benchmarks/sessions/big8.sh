#!/usr/bin/env bash
# Session 8, call 2, on the two-H200 host (256 GiB of host memory, which full-8b's host
# states need; one GPU used): the host AdamW over 4 KiB against 2 MiB pages, the pinning
# rates of this host, then full-8b as a plan-accuracy row with the faster trace (huge-page
# host arena, no host updates in the trace, one step fewer). Needs .whl and COMMIT.
set -u
source benchmarks/sessions/lib.sh
export CUDA_VISIBLE_DEVICES=0
free -g | head -2; nproc
timeout 120 python3 benchmarks/host_adam_pages.py --numel 268435456 --out "$OUT/host-adam-pages.jsonl" 2>&1 | tail -4
timeout 90 python3 benchmarks/host_pinning.py --gib 16 --out "$OUT/host-pinning.jsonl" 2>&1 | tail -10
timeout $(( $(left) - 10 )) python3 benchmarks/plan_accuracy.py --run-id "$RID" \
  --out "$OUT/plan-accuracy.jsonl" --profiles "$OUT/profiles" --timeout-s 400 \
  --only full-8b,full-3b,extra-8b-full-40-b1-s2048 2>&1 | grep -v '^{' | tail -3
[ -d "$OUT/profiles" ] && tar -czf "$OUT/profiles.tgz" -C "$OUT" profiles && rm -rf "$OUT/profiles"
python3 - "$OUT/plan-accuracy.jsonl" <<'PY'
import json, sys
for l in open(sys.argv[1]):
    r = json.loads(l)
    print(r["config"], r["status"], "plan_s", r.get("plan_s"), r.get("trace_phases_s"), r.get("trace_wrap_build_s"),
          "first step", r.get("time_to_first_step_s"), r.get("wrap_build_s"), "peak_err", r.get("peak_error"), "step_err", r.get("step_error"))
PY
echo "elapsed $((SECONDS - T0)) s"
