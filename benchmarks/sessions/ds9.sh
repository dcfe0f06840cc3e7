#!/usr/bin/env bash
# Session 9, one H100: full-3b (24 GiB, batch 4 x 2048, no clipping) with DeepSpeed ZeRO-3
# offload and ProTrain in auto mode in one run (the 2.5x the issue asks; session 7: 2.30x),
# then the matrix's plan-accuracy rows on the final trace while time is left. Needs .whl
# (with the DeepSpeed source) and COMMIT.
set -u
source benchmarks/sessions/lib.sh
lscpu | grep -i 'numa\|model name\|^cpu(s)' ; free -g | head -2
python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-cache-dir --upgrade \
  --target /tmp/site .whl/deepspeed-0.19.8.tar.gz 2>&1 | tail -2
row 250 --workload full-3b --system ds_z3_offload --out "$OUT/auto.jsonl"
row 160 --workload full-3b $A --out "$OUT/auto.jsonl"
PA="python3 benchmarks/plan_accuracy.py --run-id $RID --out $OUT/plan-accuracy.jsonl --profiles $OUT/profiles"
l=$(left); [ "$l" -gt 60 ] && timeout $(( l - 8 )) $PA --timeout-s 150 --only "${ONLY:-full-3b,fits-b1,fits-b8}" \
  2>&1 | grep -v '^{' | grep -i 'configurations ran\|peak error\|Error' | tail -4
python3 - "$OUT" <<'PY'
import json, os, sys
for f in ("auto.jsonl", "plan-accuracy.jsonl"):
    p = os.path.join(sys.argv[1], f)
    for l in open(p) if os.path.exists(p) else []:
        r = json.loads(l)
        print(r.get("system", r.get("config")), r.get("status"), r.get("tokens_per_s"),
              r.get("step_s"), r.get("plan"), r.get("step_error"), r.get("peak_error"),
              r.get("plan_s"), r.get("host_adam_s"), r.get("wait_cpu_optimizer_s"),
              r.get("alloc_retries_per_step"), r.get("error", "")[:200])
PY
[ -d "$OUT/profiles" ] && tar -czf "$OUT/profiles.tgz" -C "$OUT" profiles && rm -rf "$OUT/profiles"
echo "elapsed $((SECONDS - T0)) s"
