#!/usr/bin/env bash
# Session 10: the engine on two GPUs over NCCL (nvidia-h100-x2 / nvidia-h200-x2).
# PART=a: the multigpu tests; full-3b at 24 GiB a GPU on 1 GPU and on 2 (sharded; replicated
#         with REPLICATED=1),
#         the same knobs (n_persist 1, n_buffer 3, HF checkpointing), no clipping.
# PART=b: full-8b at 24 GiB a GPU, batch 4 x 2048 a GPU, no clipping, on 2 GPUs: ProTrain
#         sharded beside FSDP2 CPU offload and DeepSpeed ZeRO-3 offload (TESTS=1: the
#         multigpu tests first).
source benchmarks/sessions/lib.sh
ONE="python3 benchmarks/run.py --commit $C --run-id $RID --steps 4 --warmup 2 --max-grad-norm 0"
TWO="torchrun --nproc-per-node 2 benchmarks/run.py --commit $C --run-id $RID --steps 4 --warmup 2 --max-grad-norm 0"
nvidia-smi -L
case "${PART:-a}" in
a)
  timeout 150 python3 -m pytest -q -p no:cacheprovider tests/multirank/test_gpu_ranks.py \
    > "$OUT/gpu-tests.log" 2>&1; grep -m3 "Error\|error" "$OUT/gpu-tests.log"; tail -2 "$OUT/gpu-tests.log"
  K="--workload full-3b --system protrain --n-persist 1 --n-buffer 3 --chunk-mib 769 --chunked-loss-tokens 4096 --out $OUT/multi-a.jsonl"
  R=$ONE row 150 $K
  R=$TWO row 170 $K --distributed-mode sharded
  [ -n "$REPLICATED" ] && R=$TWO row 150 $K --distributed-mode replicated
  ;;
b)
  [ -n "$TESTS" ] && { timeout 120 python3 -m pytest -q -p no:cacheprovider tests/multirank/test_gpu_ranks.py \
    > "$OUT/gpu-tests.log" 2>&1; grep -m3 "Error\|Mismatch\|Greatest" "$OUT/gpu-tests.log"; tail -1 "$OUT/gpu-tests.log"; }
  python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-cache-dir --upgrade \
    --target /tmp/site .whl/deepspeed-0.19.8.tar.gz >/dev/null 2>&1
  W="--workload full-8b --budget-gib 24 --out $OUT/multi-b.jsonl"
  R=$TWO row 200 $W --system protrain --n-persist 0 --n-buffer 3 --chunked-loss-tokens 4096 --distributed-mode sharded
  R=$TWO row 170 $W --system fsdp2_offload
  R=$TWO row 200 $W --system ds_z3_offload
  ;;
esac
free -g | head -2
