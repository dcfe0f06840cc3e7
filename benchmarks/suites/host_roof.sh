#!/usr/bin/env bash
# The host's side of an offloaded step: the one-pass kernel's build (seconds, once per CPU
# capability), the host's memory roof beside torch's fused CPU AdamW with every local rank
# at once (host_adam_ranks.py), and the one pass against torch's path per parameter, with and
# without unscale and clip (host_step.py).
#   PROCS  process counts for the roof (default "1"; "1 2" on a two-GPU host)
#   NUMEL  parameters a timing (default 2^28: 1 GiB a fp32 state, beyond any cache)
source "$(dirname "$0")/lib.sh"
machine
python3 - <<'PY' 2>&1 | tee "$OUT/kernel-build.log"
import logging, time
logging.basicConfig(level=logging.INFO, format="%(message)s")
import torch
from protrain.optim import host_adam_ext
t0 = time.perf_counter()
k = host_adam_ext.kernel()
print(f"capability {host_adam_ext.capability()}, kernel {'built' if k else 'none'} "
      f"in {time.perf_counter() - t0:.1f} s, torch {torch.__version__}, {torch.get_num_threads()} threads")
PY
N=${NUMEL:-$((1 << 28))}
timeout 150 python3 benchmarks/host_adam_ranks.py --procs ${PROCS:-1} --numel "$N" \
  --out "$OUT/host_roof.jsonl"
for clip in "" "--clip"; do
  timeout 120 python3 benchmarks/host_step.py --numel "$N" $clip --states bf16 8bit \
    --out "$OUT/host_step.jsonl"
done
echo "elapsed $((SECONDS - T0)) s"
