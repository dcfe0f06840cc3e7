#!/usr/bin/env bash
# Session 23's GPU calls. Run from a `git archive` of COMMIT without benchmarks/results,
# carrying the wheel folder WHL names (see benchmarks/README.md).
# PART=one (one GPU, WHL=.whl: bitsandbytes): the host's memory roof beside its fused AdamW
#   (host_adam_ranks.py, one process), then qlora-70b auto at batch 2 (issue 22: at least
#   1,000 tokens/s on an H100 and an H200 host; session 22's H100: 1,028).
# PART=two (2 GPUs, WHL=.whl-lite): the roof and AdamW of 1 and 2 processes at once, then
#   full-8b at 24 GiB a GPU, auto and FSDP2 CPU offload in one run (issue 17: 2x), so that
#   the ratio and the bound the host's memory sets are measured on one host.
# PART=three (one GPU, WHL=.whl-ds): full-3b at 24 GiB, no clipping, in one run: auto, FSDP2
#   CPU offload, DeepSpeed ZeRO-3 offload (issue 22: 2x and 2.5x; met in session 19 on an
#   H100 and an H200 host, not measured since), on the current engine.
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
three)
  row 170 --workload full-3b $A --out "$OUT/full3b.jsonl"
  row 120 --workload full-3b --system fsdp2_offload --out "$OUT/full3b.jsonl"
  python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-cache-dir \
    --upgrade --target /tmp/site "$WHL"/deepspeed-0.19.8.tar.gz >/dev/null 2>&1
  row 240 --workload full-3b --system ds_z3_offload --out "$OUT/full3b.jsonl"
  ;;
esac
echo "elapsed $((SECONDS - T0)) s"
