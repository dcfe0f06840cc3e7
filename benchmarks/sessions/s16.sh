#!/usr/bin/env bash
# Session 16. Run from the working tree (clean at COMMIT), carrying .whl (bitsandbytes too).
# PART=fsdp2 (2 GPUs, nvidia-h100-x2 / nvidia-h200-x2): issue 19's acceptance rows, through
#   torchrun --nproc-per-node 2, 24 GiB a GPU, no clipping, chunked loss of 4096 tokens,
#   every decoder layer recomputed, 3 timed steps after 2 (qlora-70b: 2 after 1). Rows 1-7:
#     1-3 full-8b: FSDP2 engine with offload_params, chunk engine sharded (n_persist 0,
#         n_buffer 3), FSDP2 engine without offload (8B fp32 states are 64 GiB a rank: "oom"
#         is the expected answer);
#     4-6 lora-14b: the same three;
#     7   qlora-70b (4-bit NF4 base, LoRA r=16, batch 1): FSDP2 engine with offload_params.
#   START=k begins at row k; a row whose limit exceeds the call's time left is not started,
#   and the call prints "next: k" for the following call on the same warm machine.
# PART=gpu (one GPU; carry .whl-lite, WHL=.whl-lite): issue 22's device-step GPU test (against
#   plain PyTorch on CUDA) and the copy-counter test, never passed on a GPU; whether the image
#   has torchvision (vlm_accuracy.py needs it). Then the same call runs issue21.sh PART=pa.
# PART=again (one GPU; carry .whl-lite, WHL=.whl-lite): PART=gpu's tests, then the matrix rows
#   that failed its targets, after this session's planner changes: the Qwen2.5-7B LoRA at
#   12 GiB (the loss chunk now the planner's) and the Mistral-7B LoRA at 48 GiB (copy bytes).
source benchmarks/sessions/lib.sh
nvidia-smi -L; nproc; free -g | head -2
case "${PART:-fsdp2}" in
fsdp2)
  R="torchrun --standalone --nproc-per-node 2 benchmarks/run.py --commit $C --run-id $RID"
  R="$R --max-grad-norm 0 --budget-gib 24 --chunked-loss-tokens 4096"
  S="--steps 3 --warmup 2"; SH="--n-persist 0 --n-buffer 3 --distributed-mode sharded"
  rows=(
    "170 --workload full-8b $S --system protrain_fsdp2_offload"
    "170 --workload full-8b $S --system protrain $SH"
    "110 --workload full-8b $S --system protrain_fsdp2"
    "150 --workload lora-14b $S --system protrain_fsdp2_offload"
    "150 --workload lora-14b $S --system protrain $SH"
    "120 --workload lora-14b $S --system protrain_fsdp2"
    "300 --workload qlora-70b --steps 2 --warmup 1 --system protrain_fsdp2_offload"
  )
  for ((i = ${START:-1}; i <= ${#rows[@]}; i++)); do
    set -- ${rows[$((i - 1))]}
    [ "$1" -gt "$(( $(left) - 5 ))" ] && { echo "next: $i"; break; }
    echo "row $i: ${*:2}"; row "$@" --out "$OUT/fsdp2.jsonl"
  done
  ;;
gpu | again)
  timeout 120 python3 -m pytest -q -p no:cacheprovider -m gpu tests/engine/test_device_step_gpu.py \
    tests/engine/test_copy_times.py 2>&1 | grep -v "^  \|warn" | tail -14 | cut -c1-400
  python3 -c "import torchvision; print('torchvision', torchvision.__version__)" 2>&1 | tail -1
  [ "$PART" = again ] && timeout $(( $(left) - 5 )) python3 benchmarks/plan_accuracy.py \
    --only "${ONLY:-holdout-qwen7b-lora-12-b3-s3072,holdout-mistral7b-lora-48-b3-s3072}" \
    --time-limit $(( $(left) - 20 )) --run-id "$RID" --out "$OUT/pa-again.jsonl" 2>&1 \
    | grep -v '^{' | grep -i 'configurations ran\|peak error\|not started\|Error' | tail -8
  ;;
esac
free -g | head -2
