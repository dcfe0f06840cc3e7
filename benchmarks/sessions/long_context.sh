#!/usr/bin/env bash
# Session 4, long context (issue 4): causal SDPA timed per backend (BACKEND skips it and names
# one), the activation GPU tests (TESTS=0 skips them), then LoRA on the Llama-3-8B shape at
# SEQS under an 80 GiB budget with the fastest backend at 65,536 tokens, the first H blocks'
# inputs on the host (split:H) and the others on the device; PREPIN=1 page-locks their host
# memory before the timed step. Calls: (1) default, SEQS=262144 H=24; (2) BACKEND=cudnn
# SEQS=393216 H=29 PREPIN=1. Needs .whl carried.
source benchmarks/sessions/lib.sh
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
free -g | head -2; nvidia-smi -L
if [ -z "${BACKEND:-}" ]; then
  timeout 90 python3 benchmarks/attention_backends.py --seqs 32768,65536,131072 \
    --out "$OUT/attention.jsonl" | cut -c1-400
  BACKEND=$(python3 -c "
import json
rows = [json.loads(l) for l in open('$OUT/attention.jsonl')]
ok = [r for r in rows if r['status'] == 'ok' and r['seq'] == 65536]
print(min(ok, key=lambda r: r['fwd_bwd_s'])['backend'] if ok else 'default')")
fi
echo "backend: $BACKEND"
# Page-locking speed, torch's default (cudaHostAlloc) against registering malloc'd pages with
# threads; the faster one is kept for the run (the held inputs are tens of GiB).
pin() { timeout 60 python3 -c "import time, torch; torch.cuda.init(); t = time.perf_counter()
x = torch.empty(4 << 30, dtype=torch.uint8, pin_memory=True); print(round(4 / (time.perf_counter() - t), 2))"; }
A=$(pin); B=$(PYTORCH_CUDA_ALLOC_CONF=$PYTORCH_CUDA_ALLOC_CONF,pinned_use_cuda_host_register:True,pinned_num_register_threads:8 pin)
echo "pinning GiB/s: default $A, host_register x8 $B"
python3 -c "import sys; sys.exit(0 if float('${B:-0}' or 0) > float('${A:-0}' or 0) else 1)" &&
  export PYTORCH_CUDA_ALLOC_CONF=$PYTORCH_CUDA_ALLOC_CONF,pinned_use_cuda_host_register:True,pinned_num_register_threads:8
echo "PYTORCH_CUDA_ALLOC_CONF=$PYTORCH_CUDA_ALLOC_CONF"
if [ "${TESTS:-1}" = 1 ]; then
  timeout 170 python3 -m pytest -q -m gpu -p no:cacheprovider tests/activations \
    tests/train/test_train_gpu.py 2>&1 | tee "$OUT/gpu-tests.log" | tail -4
fi
timeout $(left) python3 benchmarks/activations_probe.py long --model llama8b --mode lora \
  --budget-gib 80 --seqs "${SEQS:-262144}" --steps 1 --warmup 0 --lora-dtype bfloat16 \
  --long-config "split:${H:-24}+tiled+chunked" --sdpa-backend "$BACKEND" ${PREPIN:+--prepin} \
  --out "$OUT/activations-long.jsonl" 2>&1 | grep -v Warning | tail -4 | cut -c1-1500
free -g | head -2
