#!/usr/bin/env bash
# Session 15. Carry .whl-ds (.whl without bitsandbytes: pydantic, pytest, DeepSpeed).
# PART=save (4-GPU host, first call): issue 18: full-8b through `protrain train` under
#            torchrun, sharded, auto at 24 GiB, 2 steps, saved on 2 GPUs: the save's own
#            seconds and host memory (checkpoint_probe.py rows inside resume_ranks' row).
# PART=four (same warm host): issue 25: lora-14b at 24 GiB a GPU on 4 GPUs in one run:
#            ProTrain auto, DeepSpeed ZeRO-3 offload at its largest batch that fits (4, 2, 1).
# PART=four2 (same warm host, same RID): FSDP2 CPU offload at batch 2 (its largest in
#            session 12) beside them; then issue 19: lora-14b on 2 GPUs through the FSDP2
#            engine with and without offload_params, beside the chunk engine sharded.
# PART=dstep (one GPU): issue 22 item 1: device-stepped offloaded chunks (n_device_step), never
#            run on CUDA before: their GPU test, then full-3b at 24 GiB through run.py, no
#            clipping, auto with n_device_step fixed at 0, auto free to choose it, FSDP2 CPU
#            offload in the same run, then n_device_step fixed at 2.
# PART=diag (one GPU): issue 19: why the FSDP2 engine exited 1 on an H100 in session 14:
#            `protrain plan` and `protrain train` of sessions/fsdp2_plan_check.py's config
#            with --debug (the whole traceback), then the check itself.
source benchmarks/sessions/lib.sh
nvidia-smi -L; nproc; free -g | head -2
W=/tmp/s15
run_on() {  # run_on <GPUs>: $R for that many GPUs of this host
  R="env CUDA_VISIBLE_DEVICES=$(seq -s, 0 $(( $1 - 1 ))) torchrun --standalone --nproc-per-node $1 benchmarks/run.py"
  R="$R --commit $C --run-id $RID --steps 3 --warmup 2 --max-grad-norm 0"
}
case "${PART:-diag}" in
save)
  df -h /tmp | tail -1
  timeout $(( $(left) - 10 )) python3 benchmarks/resume_ranks.py --commit "$C" --shape llama8b \
    --device cuda --gpu-budget 24GiB --save-on 2 --resume-on --window 2 --steps 2 \
    --work $W/rr --out "$OUT/resume8b.jsonl" 2>&1 | grep '^{\|Error\|error' | cut -c1-8000
  grep -v "it/s\]" $W/rr/save-2.log | grep -i "save\|export\|error" | tail -8 | cut -c1-300
  ;;
four)
  O14="--workload lora-14b --budget-gib 24 --out $OUT/four.jsonl"
  run_on 4
  row 170 $O14 $A
  python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-cache-dir --upgrade \
    --target /tmp/site ../.whl-ds/deepspeed-0.19.8.tar.gz >/dev/null 2>&1
  for b in 4 2 1; do  # ZeRO-3 at its largest batch that fits
    out=$(row 200 $O14 --system ds_z3_offload --batch $b); echo "${out:-no row}"
    echo "$out" | grep -q '"status": "oom"' || break
  done
  ;;
ds)  # ZeRO-3's row printed nothing in PART=four: its whole tail. Run as B=2, then B=4 under
  # `timeout 250`, with --steps 2 --warmup 1 (run_on's steps were edited so for these calls)
  run_on 4; R="${R/--steps 3 --warmup 2/--steps 2 --warmup 1}"; ls /tmp/site | grep -i deepspeed | head -3
  python3 -c "import deepspeed; print(deepspeed.__version__)" 2>&1 | tail -2
  timeout 440 $R --workload lora-14b --budget-gib 24 --out $OUT/four.jsonl --system ds_z3_offload \
    --batch ${B:-4} 2>&1 | grep -v "^\[\|warn" | tail -25 | cut -c1-400
  ;;
four2)  # run: only its first row (FSDP2 b2 on 4 GPUs, limit 190 s), after PART=ds B=4 in the
  # same call; the device time left did not cover the FSDP2 engine rows below
  run_on 4
  row 190 --workload lora-14b --budget-gib 24 --out $OUT/four.jsonl --system fsdp2_offload --batch 2
  run_on 2; R="$R --chunked-loss-tokens 4096"
  K="--workload lora-14b --budget-gib 24 --out $OUT/fsdp2.jsonl"
  row 150 $K --system protrain_fsdp2_offload
  row 150 $K --system protrain --n-persist 0 --n-buffer 3 --distributed-mode sharded
  row 120 $K --system protrain_fsdp2
  ;;
dstep)
  timeout 100 python3 -m pytest -q -p no:cacheprovider -m gpu tests/engine/test_device_step_gpu.py \
    tests/engine/test_copy_times.py 2>&1 | grep -v "^  \|warn" | tail -12 | cut -c1-300
  R="python3 benchmarks/run.py --commit $C --run-id $RID --steps 5 --warmup 2 --max-grad-norm 0"
  K="--workload full-3b --budget-gib 24 --out $OUT/dstep.jsonl"
  row 150 $K --system protrain --auto --n-device-step 0
  row 150 $K --system protrain --auto
  row 120 $K --system fsdp2_offload
  row 130 $K --system protrain --auto --n-device-step 2
  python3 - "$OUT/dstep.jsonl" <<'PY'
import json, sys
for line in open(sys.argv[1]):
    r = json.loads(line); p = r.get("plan") or {}
    keys = ("system", "status", "tokens_per_s", "step_s", "predicted_step_s", "peak_alloc_gib",
            "peak_reserved_gib", "predicted_peak_gib", "host_adam_s", "wait_cpu_optimizer_s",
            "device_step_s", "device_step_h2d_bytes", "copy_busy_s", "error")
    print(json.dumps({**{k: r.get(k) for k in keys}, "n_device_step": p.get("n_device_step"),
                      "n_persist": p.get("n_persist"), "n_buffer": p.get("n_buffer"),
                      "n_checkpoint": p.get("n_checkpoint")}))
PY
  ;;
diag)
  timeout 240 python3 benchmarks/sessions/fsdp2_plan_check.py $W/fsdp2 $W/fsdp2.jsonl 2>&1 | tail -2 | cut -c1-2500
  grep -q '"train_rc": 0' $W/fsdp2.jsonl && exit 0  # else the whole traceback of one train
  for f in $W/fsdp2/fsdp2-False.yaml; do
    PROTRAIN_DEBUG=1 timeout 120 torchrun --standalone --nproc-per-node 1 -m protrain train "$f" 2>&1 \
      | grep -v "it/s\]\|^  [a-z_]*:\|^[a-z_]*:" | tail -45 | cut -c1-400
  done
  ;;
esac
