#!/usr/bin/env bash
# Session 8, call 4, on the two-H200 host (one GPU used): calls 2-3 ran the "huge-page" arena
# as a MAP_SHARED mapping, which Linux backs with shmem and never gives huge pages. With the
# mapping private: the host AdamW over 4 KiB against 2 MiB pages, then full-8b and full-3b
# as plan-accuracy rows (plan time, and the host AdamW against call 3's plain-arena rows).
# Needs .whl and COMMIT.
set -u
source benchmarks/sessions/lib.sh
export CUDA_VISIBLE_DEVICES=0
timeout 100 python3 benchmarks/host_adam_pages.py --numel 268435456 --out "$OUT/host-adam-pages.jsonl" 2>&1 | tail -4
timeout $(( $(left) - 10 )) python3 benchmarks/plan_accuracy.py --run-id "$RID" \
  --out "$OUT/plan-accuracy.jsonl" --profiles "$OUT/profiles" --timeout-s 300 \
  --only full-8b,full-3b 2>&1 | grep -v '^{' | tail -2
[ -d "$OUT/profiles" ] && tar -czf "$OUT/profiles.tgz" -C "$OUT" profiles && rm -rf "$OUT/profiles"
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
