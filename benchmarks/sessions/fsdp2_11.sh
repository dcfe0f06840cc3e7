#!/usr/bin/env bash
# Session 11: ProTrain's FSDP2 engine (fsdp_version: 2, issue 19) on two GPUs over NCCL
# (nvidia-h200-x2 / nvidia-h100-x2), beside the chunk engine's sharded mode.
# Every row: torchrun --nproc-per-node 2, 24 GiB a GPU, no clipping, chunked loss of 4096
# tokens, every decoder layer recomputed (FSDP2 engine: fsdp_config.activation_checkpointing;
# chunk engine: HF checkpointing), 4 timed steps after 2 untimed ones.
# PART=a: full-8b, batch 4 x 2048 a GPU: the FSDP2 engine with its shards on the GPU
#         (protrain_fsdp2: 8B fp32 parameters, gradients and AdamW are 64 GiB a rank, so an
#         "oom" row is the expected answer), with offload_params (protrain_fsdp2_offload),
#         and the chunk engine sharded (n_persist 0, n_buffer 3). About 6 minutes.
# PART=b: lora-14b (bf16 base, LoRA r=16), batch 4 x 2048 a GPU: the same three rows.
#         About 5 minutes.
# PART=c: qlora-70b (4-bit NF4 base, LoRA r=16), batch 1 x 2048 a GPU, through the FSDP2
#         engine with offload_params (the FSDP-QLoRA anchor: 70B on 2 x 24 GB); 2 timed steps
#         after 1, since building the 4-bit base takes most of the row (two minutes and more
#         on one GPU in session 5); NOOFFLOAD=1 adds the row without offload after it.
#         About 4 minutes (8 with NOOFFLOAD=1).
# Row limits 170 + 170 + 120 s (a and b; two minutes and less expected each), 280 s (c).
# Rows go to $OUT/fsdp2-<part>.jsonl; a row that runs out of time prints "skipped (time)".
source benchmarks/sessions/lib.sh
TWO="torchrun --nproc-per-node 2 benchmarks/run.py --commit $C --run-id $RID --max-grad-norm 0 --budget-gib 24 --chunked-loss-tokens 4096"
nvidia-smi -L
case "${PART:-a}" in
a | b)
  W=$([ "${PART:-a}" = a ] && echo full-8b || echo lora-14b)
  K="--workload $W --steps 4 --warmup 2 --out $OUT/fsdp2-${PART:-a}.jsonl"
  R=$TWO row 170 $K --system protrain_fsdp2_offload
  R=$TWO row 170 $K --system protrain --n-persist 0 --n-buffer 3 --distributed-mode sharded
  R=$TWO row 120 $K --system protrain_fsdp2  # last: cut first when time runs short
  ;;
c)
  K="--workload qlora-70b --steps 2 --warmup 1 --out $OUT/fsdp2-c.jsonl"
  R=$TWO row 280 $K --system protrain_fsdp2_offload
  [ -n "$NOOFFLOAD" ] && R=$TWO row 240 $K --system protrain_fsdp2
  ;;
esac
free -g | head -2
