#!/usr/bin/env bash
# Session 23's GPU calls. Run from a `git archive` of COMMIT without benchmarks/results,
# carrying the wheel folder WHL names (see benchmarks/README.md).
# PART=one (one GPU, WHL=.whl: bitsandbytes): the host's memory roof beside its fused AdamW
#   (host_adam_ranks.py, one process), then qlora-70b auto at batch 2 (issue 22: at least
#   1,000 tokens/s on an H100 and an H200 host; session 22's H100: 1,028).
# PART=two (2 GPUs, WHL=.whl-lite): the roof and AdamW of 1 and 2 processes at once, then
#   full-8b at 24 GiB a GPU, auto and FSDP2 CPU offload in one run (issue 17: 2x), so that
#   the ratio and the bound the host's memory sets are measured on one host.
source benchmarks/sessions/lib.sh
nvidia-smi -L; nproc; free -g | head -2
lscpu | grep -i "numa node(s)\|model name\|socket(s)\|core(s) per"
case "${PART:-one}" in
one)
  timeout 120 python3 benchmarks/host_adam_ranks.py --procs 1 --numel $((1 << 30)) \
    --out "$OUT/host_adam.jsonl"
  row 300 --workload qlora-70b $A --batch 2 --out "$OUT/qlora70b.jsonl"
  ;;
two)
  timeout 150 python3 benchmarks/host_adam_ranks.py --procs 1 2 --numel $((1 << 30)) \
    --out "$OUT/host_adam.jsonl"
  R="torchrun --standalone --nproc-per-node 2 benchmarks/run.py --commit $C --run-id $RID"
  R="$R --steps 4 --warmup 2 --max-grad-norm 0 --budget-gib 24"
  row 190 --workload full-8b $A --out "$OUT/full8b.jsonl"
  row 130 --workload full-8b --system fsdp2_offload --out "$OUT/full8b.jsonl"
  ;;
esac
echo "elapsed $((SECONDS - T0)) s"
