#!/usr/bin/env bash
# Session 9, on the two-H200 host (one GPU used; 256 GiB of host memory for 8B full
# fine-tuning): the final trace (four steps; no landing places in the trace's arena; its
# offloaded gradients in one shared scratch area) on a freshly started host: full-8b's plan
# time, peak and step error; then the matrix's long-8b shape at 65,536 tokens and
# extra-8b-full-40 while time is left. Needs .whl and COMMIT.
set -u
source benchmarks/sessions/lib.sh
export CUDA_VISIBLE_DEVICES=0
lscpu | grep -i 'numa\|model name\|^cpu(s)' ; free -g | head -2
PA="python3 benchmarks/plan_accuracy.py --run-id $RID --out $OUT/plan-accuracy.jsonl --profiles $OUT/profiles"
for cfg in full-8b long-8b-s65536 extra-8b-full-40-b1-s2048; do
  l=$(left); [ "$l" -lt 150 ] && { echo "skipped (time): $cfg"; continue; }
  timeout $(( l - 8 )) $PA --timeout-s $(( l - 12 )) --only $cfg 2>&1 | grep -v '^{' \
    | grep -i 'configurations ran\|peak error\|Error' | tail -3
done
python3 - "$OUT/plan-accuracy.jsonl" <<'PY'
import json, sys
for l in open(sys.argv[1]):
    r = json.loads(l)
    print(r["config"], r["status"], r.get("plan"), "plan_s", r.get("plan_s"), "step",
          r.get("step_error"), "peak", r.get("peak_error"), r.get("trace_phases_s"),
          r.get("trace_wrap_build_s"), r.get("error", "")[:300])
PY
[ -d "$OUT/profiles" ] && tar -czf "$OUT/profiles.tgz" -C "$OUT" profiles && rm -rf "$OUT/profiles"
echo "elapsed $((SECONDS - T0)) s"
