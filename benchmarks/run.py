"""Run one row of the benchmark matrix for one system, in this process, and append one JSON
line to the results file (format: shared/BENCHMARKS.md, "Results format").

    python benchmarks/run.py --workload full-3b --system fsdp2_offload --run-id R1

`--tiny` swaps in a tiny model on the CPU with no budget: a check of the harness, not a
measurement.

Under `torchrun --nproc-per-node N` every rank runs the row on its own GPU (`LOCAL_RANK`)
with the row's batch and budget each, on its own random batch; `tokens_per_s` is the whole
job's (N x batch x seq per step), peaks are the largest over ranks, and rank 0 writes the
row (`world_size` N).
"""

from __future__ import annotations

import time

_START = time.perf_counter()  # time to first step counts from here, imports included

import sys  # noqa: E402

from protrain.runtime.allocator import prefer_expandable_segments  # noqa: E402

# ProTrain's application asks the CUDA allocator for expandable segments before CUDA starts
# (protrain.runtime.allocator); its rows do the same, so that they measure what users run.
# The baselines keep PyTorch's default allocator. Each row records the setting.
if any(arg.startswith("protrain") for arg in sys.argv[1:]):  # either engine
    prefer_expandable_segments()

import argparse  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import os  # noqa: E402
import subprocess  # noqa: E402
import traceback  # noqa: E402
from datetime import datetime, timezone  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))

import systems  # noqa: E402
from workloads import LORA_RANK, MODEL_SHAPES, SYSTEMS, WORKLOADS  # noqa: E402

_GIB = 2**30
REPO = Path(__file__).resolve().parent.parent


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--workload", required=True, choices=sorted(WORKLOADS))
    p.add_argument("--system", required=True, choices=SYSTEMS)
    p.add_argument("--batch", type=int, help="default: the workload's first batch size")
    p.add_argument("--seq", type=int, help="default: the workload's sequence length")
    p.add_argument("--budget-gib", type=float, help="default: the workload's budget")
    p.add_argument("--steps", type=int, default=5, help="timed steps")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps before them")
    p.add_argument("--n-persist", type=int)
    p.add_argument("--n-buffer", type=int)
    p.add_argument("--chunk-mib", type=float, help="protrain: chunk size (default: the engine's)")
    p.add_argument("--host-threads", type=int, help="protrain: host AdamW intra-op threads")
    p.add_argument(
        "--n-device-step", type=int,
        help="protrain: offloaded chunks whose AdamW runs on the GPU (with --auto: fixed for "
             "the planner, which picks the other knobs for it)",
    )  # fmt: skip
    p.add_argument(
        "--device-step-search", action="store_true",
        help="protrain --auto: the planner also chooses n_device_step (memory.device_step_search)",
    )  # fmt: skip
    p.add_argument(
        "--auto", action="store_true",
        help="protrain: knobs from the planner (wrap(gpu_budget=, sample_batch=)) instead of "
             "--n-persist/--n-buffer; the engine's activation policies replace HF checkpointing",
    )  # fmt: skip
    p.add_argument(
        "--chunked-loss-tokens", type=int,
        help="protrain: the app's chunked loss (memory.chunked_loss_tokens), N tokens of logits "
             "at a time, in training and in the planner's trace (default: the model's own loss)",
    )  # fmt: skip
    p.add_argument(
        "--distributed-mode", choices=["sharded", "replicated"],
        help="protrain under torchrun: how offloaded chunks are kept across ranks",
    )  # fmt: skip
    p.add_argument(
        "--no-checkpointing", action="store_true",
        help="plain / protrain with fixed knobs: no activation recompute (the default recomputes "
             "every decoder layer); the row records checkpointing: none",
    )  # fmt: skip
    p.add_argument(
        "--profiles", type=Path,
        help="protrain --auto: write the planner's model and hardware profiles here "
             "(<workload>-b<batch>-s<seq>-<budget>g-w<world>.profile.json.gz, .hardware.json; "
             "the first rank writes) to re-plan the row offline",
    )  # fmt: skip
    p.add_argument(
        "--grad-accum", type=int, default=1,
        help="micro-batches of --batch rows per optimizer step (every system accumulates)",
    )  # fmt: skip
    p.add_argument(
        "--host-update", choices=["auto", "torch"], default="auto",
        help="protrain: the host update of offloaded chunks: the one-pass kernel where it "
             "builds (auto), or torch's fused AdamW (PROTRAIN_HOST_ADAM=torch)",
    )  # fmt: skip
    p.add_argument(
        "--optimizer-state", choices=["fp32", "bf16", "8bit"], default="fp32",
        help="protrain: how the host keeps offloaded chunks' Adam moments (opt-in compact "
             "formats change the math: optimizer_state)",
    )  # fmt: skip
    p.add_argument(
        "--kernels", choices=["auto", "none"], default="none",
        help="protrain: Liger Kernel's fused kernels (model.kernels; auto: those of the family "
             "on a CUDA GPU where liger-kernel is installed); the row records which ran",
    )  # fmt: skip
    p.add_argument(
        "--attn", choices=["sdpa", "flex_attention"], default="sdpa",
        help="plain, plain_liger: the model's attn_implementation (flex_attention needs a CUDA "
             "GPU: torch has no flex_attention backward on the CPU)",
    )  # fmt: skip
    p.add_argument(
        "--pack-samples", type=int, default=0,
        help="plain, plain_liger, with --batch 1: the row is one pack of K samples of seq/K "
             "tokens, position_ids restarting at each, no attention mask (sample_packing's "
             "micro-batch); sdpa then gets a dense seq x seq mask, flex_attention a BlockMask",
    )  # fmt: skip
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--max-grad-norm", type=float, default=1.0, help="0: no clipping")
    p.add_argument("--out", type=Path, help="default: benchmarks/results/<workload>.jsonl")
    p.add_argument("--run-id", help="rows measured side by side share one (default: new)")
    p.add_argument("--commit", help="default: git rev-parse --short HEAD")
    p.add_argument("--tiny", action="store_true", help="tiny model on the CPU, no budget")
    args = p.parse_args(argv)
    if args.profiles and not args.auto:
        p.error("--profiles writes the planner's profiles: add --auto")
    if (args.pack_samples or args.attn != "sdpa") and args.system not in ("plain", "plain_liger"):
        p.error("--pack-samples and --attn are read by --system plain and plain_liger only")
    if args.pack_samples < 0 or (args.pack_samples and args.batch not in (None, 1)):
        p.error("--pack-samples K: K >= 1 samples in one row; a pack is one row: --batch 1")
    if args.attn == "flex_attention" and args.tiny:
        p.error("--attn flex_attention needs a CUDA GPU: torch has no flex_attention backward "
                "on the CPU")  # fmt: skip
    if args.device_step_search and not args.auto:
        p.error("--device-step-search is read only by the planner: add --auto, or fix "
                "--n-device-step yourself")  # fmt: skip
    return args


def git_commit() -> str:
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True
        )
        if head.returncode != 0:
            return "unknown"
        dirty = subprocess.run(["git", "diff", "--quiet", "HEAD"], cwd=REPO).returncode != 0
        return head.stdout.strip() + ("-dirty" if dirty else "")
    except OSError:
        return "unknown"


def row_spec(args: argparse.Namespace) -> systems.RowSpec:
    workload = WORKLOADS[args.workload]
    if args.tiny:
        device, model = torch.device("cpu"), "tiny"
        batch, seq, budget = (1 if args.pack_samples else args.batch or 2), args.seq or 32, None
    else:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        model = workload.model
        batch = 1 if args.pack_samples else args.batch or workload.batches[0]
        seq = args.seq or workload.seq
        budget = args.budget_gib if args.budget_gib is not None else workload.budget_gib
    return systems.RowSpec(
        workload=args.workload,
        system=args.system,
        model=model,
        mode=workload.mode,
        batch=batch,
        seq=seq,
        budget_gib=budget,
        device=device,
        lora_rank=LORA_RANK if workload.mode in ("lora", "qlora") else None,
        lr=args.lr,
        max_grad_norm=args.max_grad_norm or None,
        n_persist=args.n_persist,
        n_buffer=args.n_buffer,
        chunk_size_bytes=int(args.chunk_mib * 2**20) if args.chunk_mib else None,
        host_threads=args.host_threads,
        n_device_step=args.n_device_step,
        device_step_search=args.device_step_search,
        auto=args.auto,
        chunked_loss_tokens=args.chunked_loss_tokens,
        distributed_mode=args.distributed_mode,
        world_size=_world_size(),
        checkpointing=not args.no_checkpointing,
        profiles=args.profiles,
        grad_accum=args.grad_accum,
        kernels=args.kernels,
        attn=args.attn,
        pack_samples=args.pack_samples,
        optimizer_state=args.optimizer_state,
    )


def _world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def init_ranks(spec: systems.RowSpec) -> None:
    """Under torchrun: the default process group (NCCL for CUDA tensors, gloo for CPU ones,
    which FSDP2's CPU offload uses), this rank bound to its GPU."""
    if spec.world_size == 1:
        return
    import torch.distributed as dist

    # torchrun sets OMP_NUM_THREADS=1 in every rank: each system's CPU work (FSDP2's and
    # DeepSpeed's host optimizers too) gets the rank's share of the node's cores instead.
    local = int(os.environ.get("LOCAL_WORLD_SIZE", spec.world_size))
    torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // local))

    if spec.device.type == "cuda":
        torch.cuda.set_device(spec.device)
        dist.init_process_group("cpu:gloo,cuda:nccl", device_id=spec.device)
    else:
        dist.init_process_group("gloo")


def _max_over_ranks(value: float) -> float:
    import torch.distributed as dist

    if not dist.is_initialized():
        return value
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def emulate_budget(spec: systems.RowSpec) -> None:
    """Cap this process's CUDA caching allocator at the budget, before anything is allocated."""
    if spec.device.type != "cuda" or spec.budget_gib is None:
        return
    total = torch.cuda.get_device_properties(spec.device).total_memory
    torch.cuda.set_per_process_memory_fraction(
        min(1.0, spec.budget_gib * _GIB / total), spec.device
    )


def measure(spec: systems.RowSpec, steps: int, warmup: int) -> dict:
    """Build the system, run warmup + timed steps; the figures of the row."""
    out: dict = {"status": "ok"}
    try:
        trainer = systems.setup(spec)
        if spec.auto and spec.device.type == "cuda":
            # the planner's trace ran in setup and gave its memory back: the row's peak is
            # the training steps', which the plan predicts
            torch.cuda.reset_peak_memory_stats(spec.device)
        out.update(plan=trainer.plan, predicted_peak_gib=trainer.predicted_peak_gib)
        out["predicted_step_s"] = trainer.predicted_step_s
        vocab = MODEL_SHAPES[spec.model]["vocab_size"]
        rank = int(os.environ.get("RANK", "0"))  # each rank its own batch
        gen = torch.Generator(device=spec.device).manual_seed(rank)
        micro_batches = [
            torch.randint(vocab, (spec.batch, spec.seq), device=spec.device, generator=gen)
            for _ in range(spec.grad_accum)
        ]
        extras_sum: dict[str, float] = {}
        for i in range(warmup + steps):
            if i == warmup:
                _sync(spec.device)
                t0 = time.perf_counter()
                retries0 = _alloc_retries(spec.device)
            loss = trainer.step(micro_batches)
            if i == 0:
                _sync(spec.device)
                out["time_to_first_step_s"] = round(time.perf_counter() - _START, 2)
            extras = trainer.extras()  # every step, so that timed steps count only their own
            if i >= warmup:
                for k, v in extras.items():
                    extras_sum[k] = extras_sum.get(k, 0.0) + v
        _sync(spec.device)
        step_s = (time.perf_counter() - t0) / steps
        step_s = _max_over_ranks(step_s)
        job_tokens = spec.batch * spec.seq * spec.grad_accum * spec.world_size
        out.update(step_s=round(step_s, 4), tokens_per_s=round(job_tokens / step_s, 1))
        out["loss"] = round(float(loss.detach()), 4)
        if spec.device.type == "cuda":  # cache flushes at the budget: a slow step's first suspect
            out["alloc_retries_per_step"] = (_alloc_retries(spec.device) - retries0) / steps
        out.update({k: round(v / steps, 4) for k, v in extras_sum.items()})
        if not math.isfinite(out["loss"]):
            out.update(status="error", error="loss is not finite")
    except torch.OutOfMemoryError as e:
        out.update(status="oom", error=_first_line(e))
    except Exception as e:  # one clear row per failure; the traceback goes to stderr
        traceback.print_exc()
        oom = "out of memory" in str(e).lower()
        out.update(status="oom" if oom else "error", error=f"{type(e).__name__}: {_first_line(e)}")
    return out


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return (text.splitlines()[0] if text else type(e).__name__)[:500]


def _alloc_retries(device: torch.device) -> int:
    """Allocations the CUDA caching allocator retried after freeing its cache (the budget
    was reached): each one synchronizes and unmaps memory."""
    if device.type != "cuda":
        return 0
    return int(torch.cuda.memory_stats(device).get("num_alloc_retries", 0))


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.host_update == "torch":  # read by the engine when it first steps on the host
        os.environ["PROTRAIN_HOST_ADAM"] = "torch"
    spec = row_spec(args)
    init_ranks(spec)
    emulate_budget(spec)
    if spec.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(spec.device)
    commit = args.commit or os.environ.get("PROTRAIN_COMMIT") or git_commit()
    now = datetime.now(timezone.utc)
    run_id = args.run_id or f"{now:%Y-%m-%dT%H:%MZ}-{commit[:7]}"

    result = measure(spec, args.steps, args.warmup)

    cuda = spec.device.type == "cuda"
    row = {
        "workload": spec.workload,
        "system": spec.system,
        "model": spec.model,
        "mode": spec.mode,
        "budget_gib": spec.budget_gib,
        "batch": spec.batch,
        "seq": spec.seq,
        "status": result.pop("status"),
        "tokens_per_s": result.pop("tokens_per_s", None),
        "step_s": result.pop("step_s", None),
        "peak_alloc_gib": round(
            _max_over_ranks(torch.cuda.max_memory_allocated(spec.device)) / _GIB, 2
        )
        if cuda
        else None,
        "peak_reserved_gib": round(
            _max_over_ranks(torch.cuda.max_memory_reserved(spec.device)) / _GIB, 2
        )
        if cuda
        else None,
        "predicted_peak_gib": result.pop("predicted_peak_gib", None),
        "predicted_step_s": result.pop("predicted_step_s", None),
        "plan": result.pop("plan", None),
        "gpu": torch.cuda.get_device_name(spec.device) if cuda else "cpu",
        "run_id": run_id,
        "commit": commit,
        "time_to_first_step_s": result.pop("time_to_first_step_s", None),
        "world_size": spec.world_size,
        # activation recompute: every decoder layer (HF) for the baselines and fixed knobs,
        # the plan's policies in auto mode
        "checkpointing": "plan" if spec.auto else ("every-layer" if spec.checkpointing else "none"),
        **result,  # extras: loss, error, and what the system reports per step
        "max_grad_norm": spec.max_grad_norm,
        "grad_accum": spec.grad_accum,
        "host_update": args.host_update,
        "optimizer_state": spec.optimizer_state,
        "chunked_loss_tokens": spec.chunked_loss_tokens,
        "kernels_setting": spec.kernels if spec.system == "protrain" else None,
        "attn": spec.attn if spec.system in ("plain", "plain_liger") else None,
        "pack_samples": spec.pack_samples,
        "steps": args.steps,
        "warmup": args.warmup,
        "torch": torch.__version__,
        "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF")
        or os.environ.get("PYTORCH_ALLOC_CONF"),
        "cpu_threads": torch.get_num_threads(),
        "date": f"{now:%Y-%m-%dT%H:%M:%SZ}",
    }
    if args.tiny:
        row["tiny"] = True
    if int(os.environ.get("RANK", "0")) != 0:  # rank 0 writes the job's row
        return 1 if row["status"] == "error" else 0
    out = args.out or REPO / "benchmarks" / "results" / f"{spec.workload}.jsonl"
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("a") as f:
        f.write(json.dumps(row) + "\n")
    print(json.dumps(row))
    return 1 if row["status"] == "error" else 0


if __name__ == "__main__":
    sys.exit(main())
