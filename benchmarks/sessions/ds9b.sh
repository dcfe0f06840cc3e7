#!/usr/bin/env bash
# Session 9, the call after ds9.sh on the same warm H100, its run id given (RID): FSDP2 CPU
# offload and ProTrain once more on full-3b (no clipping), then fits at batch 1 and 8 beside
# plain PyTorch (80 GiB budget: the H100's whole memory). Needs .whl, COMMIT and RID.
set -u
source benchmarks/sessions/lib.sh
row 150 --workload full-3b --system fsdp2_offload --out "$OUT/auto.jsonl"
row 120 --workload full-3b $A --out "$OUT/auto.jsonl"
for b in 1 8; do
  row 90 --workload fits --batch $b --system plain --max-grad-norm 1.0 --out "$OUT/auto.jsonl"
  row 90 --workload fits --batch $b $A --max-grad-norm 1.0 --out "$OUT/auto.jsonl"
done
python3 - "$OUT/auto.jsonl" <<'PY'
import json, sys
for l in open(sys.argv[1]):
    r = json.loads(l)
    print(r["workload"], r["batch"], r["system"], r["status"], r.get("tokens_per_s"), r.get("step_s"),
          r.get("plan"), r.get("peak_reserved_gib"), r.get("host_adam_s"), r.get("error", "")[:200])
PY
echo "elapsed $((SECONDS - T0)) s"
