#!/usr/bin/env bash
# Activation policies and long context on one GPU (benchmarks/activations_probe.py): causal
# SDPA timed per fused backend, then LoRA on the Llama-3-8B shape at SEQS tokens under an
# 80 GiB budget with the fastest backend at 65,536 tokens, the first H blocks' inputs on the
# host (split:H), the MLP tiled and the loss chunked.
#   SEQS (default 262144), H (default 24), BACKEND (skips the timing), PREPIN=1 (page-lock
#   the held inputs before the timed step), POLICIES=1 (first: each policy against keep at
#   8,192 tokens)
source "$(dirname "$0")/lib.sh"
machine
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
if [ "${POLICIES:-0}" = 1 ]; then
  timeout 230 python3 benchmarks/activations_probe.py policies --model llama8b --mode lora \
    --seq 8192 --steps 2 --warmup 1 --out "$OUT/activations-8b.jsonl" 2>&1 | tail -15
fi
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
timeout $(( $(left) - 5 )) python3 benchmarks/activations_probe.py long --model llama8b \
  --mode lora --budget-gib 80 --seqs "${SEQS:-262144}" --steps 1 --warmup 0 \
  --lora-dtype bfloat16 --long-config "split:${H:-24}+tiled+chunked" --sdpa-backend "$BACKEND" \
  ${PREPIN:+--prepin} --out "$OUT/activations-long.jsonl" 2>&1 | grep -v Warning | tail -4 | cut -c1-1500
echo "elapsed $((SECONDS - T0)) s"
