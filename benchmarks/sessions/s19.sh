#!/usr/bin/env bash
# Session 19's GPU calls (written in session 18). Run from a clean tree
# at COMMIT (or a `git archive` of it), carrying .whl-ds (pydantic, pytest, DeepSpeed; see
# benchmarks/README.md), WHL=.whl-ds.
# PART=dstep1 (one GPU): the device step's GPU tests (gradients now on the host, streamed up
#   with the masters and moments), then full-3b at 24 GiB, no clipping, in one run: auto
#   with the planner choosing n_device_step (--device-step-search), auto without it, FSDP2
#   CPU offload, DeepSpeed ZeRO-3 offload (issue 22: 2x and 2.5x on every host).
# PART=dstep2 (2 GPUs, nvidia-h100-x2 / nvidia-h200-x2): the multigpu tests, then full-8b at
#   24 GiB a GPU, 4 x 2048 a GPU, no clipping, in one run: auto sharded with and without
#   --device-step-search, FSDP2 CPU offload; DeepSpeed ZeRO-3 offload with START=4 in a
#   second call on the same warm machine (same RID) if the first runs out of time (#17).
# PART=lora14b (one GPU): lora-14b at 24 GiB, auto beside FSDP2 CPU offload at batch 3 (its
#   largest that fits) and 2 (issue 22: 3x at FSDP2's largest batch).
# PART=fix (one GPU, WHL=.whl-lite): the device step's GPU tests, then full-3b auto with and
#   without --device-step-search, after 7253d04 (the step enqueues without waiting).
# PART=eightbit (one GPU, WHL=.whl: bitsandbytes): the 8-bit optimizer's GPU tests against
#   bitsandbytes' AdamW8bit, its memory on a Llama-3-8B shape, then qlora-70b auto (issue 22:
#   at least 1,000 tokens/s).
source benchmarks/sessions/lib.sh
nvidia-smi -L; nproc; free -g | head -2
install_ds() {
  python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-cache-dir --upgrade \
    --target /tmp/site "${WHL:-.whl}"/deepspeed-0.19.8.tar.gz >/dev/null 2>&1
}
run_rows() {  # run_rows <out> <rows...>: each "limit args", from START, stopping before the limit
  local out=$1; shift; local rows=("$@")
  for ((i = ${START:-1}; i <= ${#rows[@]}; i++)); do
    set -- ${rows[$((i - 1))]}
    [ "$1" -gt "$(( $(left) - 5 ))" ] && { echo "next: START=$i"; break; }
    echo "row $i: ${*:2}"
    [[ "$*" == *ds_z3* ]] && install_ds
    row "$@" --out "$out"
  done
}
case "${PART:-dstep1}" in
dstep1)
  [ "${START:-1}" = 1 ] && timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu \
    tests/engine/test_device_step_gpu.py 2>&1 | grep -v "^  \|warn" | tail -8 | cut -c1-400
  run_rows "$OUT/dstep1.jsonl" \
    "170 --workload full-3b $A --device-step-search" \
    "150 --workload full-3b $A" \
    "120 --workload full-3b --system fsdp2_offload" \
    "220 --workload full-3b --system ds_z3_offload"
  ;;
dstep2)
  [ "${START:-1}" = 1 ] && timeout 120 python3 -m pytest -q -p no:cacheprovider -m multigpu \
    tests/multirank/test_gpu_ranks.py 2>&1 | grep -v "^  \|warn" | tail -8 | cut -c1-400
  R="torchrun --standalone --nproc-per-node 2 benchmarks/run.py --commit $C --run-id $RID"
  R="$R --steps 4 --warmup 2 --max-grad-norm 0 --budget-gib 24"
  run_rows "$OUT/dstep2.jsonl" \
    "190 --workload full-8b $A --device-step-search" \
    "170 --workload full-8b $A" \
    "130 --workload full-8b --system fsdp2_offload" \
    "240 --workload full-8b --system ds_z3_offload"
  ;;
lora14b)
  row 200 --workload lora-14b $A --out "$OUT/lora14b.jsonl"
  row 130 --workload lora-14b --system fsdp2_offload --batch 3 --out "$OUT/lora14b.jsonl"
  row 120 --workload lora-14b --system fsdp2_offload --batch 2 --out "$OUT/lora14b.jsonl"
  ;;
fix)
  timeout 90 python3 -m pytest -q -p no:cacheprovider -m gpu tests/engine/test_device_step_gpu.py \
    2>&1 | grep -v "^  \|warn" | tail -6 | cut -c1-600
  row 170 --workload full-3b $A --device-step-search --out "$OUT/fix.jsonl"
  row 150 --workload full-3b $A --out "$OUT/fix.jsonl"
  ;;
eightbit)
  timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu tests/optim/test_adamw_8bit.py \
    tests/train/test_optimizer_8bit.py 2>&1 | grep -E "passed|failed|error|Error" | tail -6
  timeout 120 python3 benchmarks/optim_8bit_memory.py --out "$OUT/mem8.jsonl" 2>&1 | tail -3 |
    cut -c1-600
  row 240 --workload qlora-70b $A --out "$OUT/qlora70b.jsonl"
  ;;
esac
echo "elapsed $((SECONDS - T0)) s"
