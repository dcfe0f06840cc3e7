"""Plan accuracy: profile + plan + real steps with the plan's knobs, predicted vs measured.

For every configuration (the benchmark matrix of shared/BENCHMARKS.md that the engine
runs, and further ones over budgets 16/24/40/80 GiB, batch 1-8, sequence 512-8192, full
fine-tuning and LoRA), in a fresh child process:

1. cap the CUDA caching allocator at the budget (``set_per_process_memory_fraction``);
2. build the model (random weights, on the host), trace it under the engine
   (``protrain.plan.auto.profile_model``) and search (``protrain.plan.loss_chunk``'s
   ``search_loss_chunks``), timed apart;
3. wrap it with the plan's knobs (``protrain.wrap`` + ``apply_activation_knobs``), run
   warm-up and timed steps, read the peak allocated and reserved bytes;
4. run the closed-loop check on what was measured;

The loss is the application's, as a user gets it who leaves ``memory.chunked_loss_tokens``
unset: the planner owns the loss chunk (traced at its smallest, the search chooses it, the
steps run the plan's); ``--chunked-loss-tokens N`` runs it as a user who fixed N. The row's
``loss_chunk`` says which (``planned``, ``fixed``; ``model``: the model's own loss) and
``chunked_loss_tokens`` the chunk the steps ran with (None: the whole logits).

Then it appends one JSON line per configuration (the results format of shared/BENCHMARKS.md,
plus ``plan_s``, ``trace_s``, ``search_s``, ``peak_error``, ``step_error`` and
``closed_loop_corrected``). The summary at the end gives the median and worst peak error
(against reserved bytes, the memory the budget limits) and the median step-time error.

    python benchmarks/plan_accuracy.py --out benchmarks/results/2026-11-22_h200_plan-accuracy.jsonl
    python benchmarks/plan_accuracy.py --only full-3b,extra-8b-lora-24-b2-s4096
    python benchmarks/plan_accuracy.py --tiny     # CPU smoke test of the script, no budget

Groups and calls (the acceptance matrix): ``--group`` picks configurations
(``matrix``: the tuned ones a one-GPU host runs; ``holdout``: held-out families and settings;
``big``: full fine-tuning of 7-8B shapes, which needs a host of >= 200 GiB, i.e. a 2-GPU
kind with one GPU used; ``all``). ``--part K/N`` runs the K-th of N parts of equal estimated
time (estimates from earlier rows in ``results/*plan-accuracy*``), ``--time-limit S`` starts
no configuration that would not end within S seconds of the start and cuts the last one
short, ``--list`` prints the parts and their estimates without running anything, and
``--summarize FILE...`` prints the summary of rows already written (per GPU, the held-out
rows apart, against the acceptance targets):

    python benchmarks/plan_accuracy.py --group matrix,holdout --list --call-s 540
    python benchmarks/plan_accuracy.py --group matrix,holdout --part 1/5 --time-limit 540 --out $OUT/pa.jsonl
    python benchmarks/plan_accuracy.py --summarize benchmarks/results/*_plan-accuracy*.jsonl
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import statistics
import subprocess
import sys
import time
import traceback
from datetime import datetime, timezone
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

_GIB = 1 << 30

# name: (model, mode, budget GiB, batch, seq, workload id of the matrix or "extra")
CONFIGS: dict[str, tuple[str, str, float, int, int, str]] = {
    "fits-b1": ("llama1b", "full", 80, 1, 2048, "fits"),
    "fits-b8": ("llama1b", "full", 80, 8, 2048, "fits"),
    "full-3b": ("llama3b", "full", 24, 4, 2048, "full-3b"),
    "full-8b": ("llama8b", "full", 80, 4, 2048, "full-8b"),
    "lora-14b": ("qwen14b", "lora", 24, 4, 2048, "lora-14b"),
    "qlora-70b": ("llama70b", "qlora", 24, 1, 2048, "qlora-70b"),
    "extra-1b-full-16-b2-s1024": ("llama1b", "full", 16, 2, 1024, "extra"),
    "extra-1b-full-24-b4-s4096": ("llama1b", "full", 24, 4, 4096, "extra"),
    "extra-1b-lora-16-b8-s2048": ("llama1b", "lora", 16, 8, 2048, "extra"),
    "extra-3b-full-16-b1-s2048": ("llama3b", "full", 16, 1, 2048, "extra"),
    "extra-3b-full-40-b2-s4096": ("llama3b", "full", 40, 2, 4096, "extra"),
    "extra-3b-lora-16-b4-s8192": ("llama3b", "lora", 16, 4, 8192, "extra"),
    "extra-3b-lora-24-b1-s512": ("llama3b", "lora", 24, 1, 512, "extra"),
    "extra-8b-full-40-b1-s2048": ("llama8b", "full", 40, 1, 2048, "extra"),
    "extra-8b-full-80-b8-s1024": ("llama8b", "full", 80, 8, 1024, "extra"),
    "extra-8b-lora-24-b2-s4096": ("llama8b", "lora", 24, 2, 4096, "extra"),
    "extra-8b-lora-16-b1-s8192": ("llama8b", "lora", 16, 1, 8192, "extra"),
    "extra-8b-lora-40-b4-s2048": ("llama8b", "lora", 40, 4, 2048, "extra"),
    "extra-14b-lora-40-b2-s2048": ("qwen14b", "lora", 40, 2, 2048, "extra"),
    "extra-14b-lora-80-b8-s512": ("qwen14b", "lora", 80, 8, 512, "extra"),
    # the 8B full fine-tuning rows above need more host memory than the GPU
    # machine's 125 GiB (about 20 bytes per offloaded parameter, plus the fp32 model)
    "extra-1b-full-40-b8-s2048": ("llama1b", "full", 40, 8, 2048, "extra"),
    "extra-3b-full-24-b8-s1024": ("llama3b", "full", 24, 8, 1024, "extra"),
    "extra-3b-lora-80-b2-s4096": ("llama3b", "lora", 80, 2, 4096, "extra"),
    # the matrix's long-8b shape (LoRA, batch 1, 80 GiB) at a sequence one GPU
    # call can trace and time (its longest that trains, 393,216, takes ~400 s a step)
    "long-8b-s65536": ("llama8b", "lora", 80, 1, 65536, "long-8b"),
}
# Held out: families, budgets, batch and sequence the models were never tuned on.
# Full fine-tuning of a 7B shape needs ~20 bytes a parameter on the host plus the fp32
# model (~180 GB): in HOLDOUT_BIG, for a host of >= 200 GiB.
HOLDOUT: dict[str, tuple[str, str, float, int, int, str]] = {
    "holdout-qwen7b-lora-12-b3-s3072": ("qwen7b", "lora", 12, 3, 3072, "holdout"),
    "holdout-qwen7b-lora-20-b1-s3072": ("qwen7b", "lora", 20, 1, 3072, "holdout"),
    "holdout-qwen7b-lora-48-b3-s2048": ("qwen7b", "lora", 48, 3, 2048, "holdout"),
    "holdout-mistral7b-lora-12-b1-s3072": ("mistral7b", "lora", 12, 1, 3072, "holdout"),
    "holdout-mistral7b-lora-20-b3-s3072": ("mistral7b", "lora", 20, 3, 3072, "holdout"),
    "holdout-mistral7b-lora-48-b3-s3072": ("mistral7b", "lora", 48, 3, 3072, "holdout"),
    "holdout-3b-full-20-b3-s3072": ("llama3b", "full", 20, 3, 3072, "holdout"),
    "holdout-1b-full-12-b3-s3072": ("llama1b", "full", 12, 3, 3072, "holdout"),
}
HOLDOUT_BIG: dict[str, tuple[str, str, float, int, int, str]] = {
    "holdout-mistral7b-full-48-b3-s3072": ("mistral7b", "full", 48, 3, 3072, "holdout"),
    "holdout-qwen7b-full-20-b1-s3072": ("qwen7b", "full", 20, 1, 3072, "holdout"),
}
# The tuned configurations that need more than a one-GPU host: 8B full fine-tuning (host
# memory) and long-8b (run on H200 hosts so far).
BIG_HOST = ("full-8b", "extra-8b-full-40-b1-s2048", "extra-8b-full-80-b8-s1024", "long-8b-s65536")
GROUPS: dict[str, list[str]] = {
    "matrix": [n for n in CONFIGS if n not in BIG_HOST],
    "holdout": list(HOLDOUT),
    "big": [*BIG_HOST, *HOLDOUT_BIG],
}
GROUPS["all"] = GROUPS["matrix"] + GROUPS["holdout"] + GROUPS["big"]
# The smallest acceptance run: 20 configurations, the 8 held out and the 12 tuned ones of
# least estimated time (~18 min on one H100 host).
GROUPS["acceptance"] = [
    "fits-b1", "fits-b8", "full-3b", "extra-1b-full-16-b2-s1024", "extra-1b-full-24-b4-s4096",
    "extra-1b-lora-16-b8-s2048", "extra-1b-full-40-b8-s2048", "extra-3b-lora-80-b2-s4096",
    "extra-3b-lora-24-b1-s512", "extra-3b-full-24-b8-s1024", "extra-3b-full-40-b2-s4096",
    "extra-8b-lora-40-b4-s2048", *HOLDOUT,
]  # fmt: skip
ALL_CONFIGS = {**CONFIGS, **HOLDOUT, **HOLDOUT_BIG}
TINY = {"tiny-full": ("tiny", "full", 1, 2, 64, "tiny"), "tiny-lora": ("tiny", "lora", 1, 2, 64, "tiny"), "tiny-qlora": ("tiny", "qlora", 1, 2, 64, "tiny"),
        "tiny-holdout-qwen2-lora": ("tiny-qwen2", "lora", 1, 3, 48, "holdout"), "tiny-holdout-mistral-full": ("tiny-mistral", "full", 1, 3, 48, "holdout")}  # fmt: skip
TINY_GROUPS = {"matrix": ["tiny-full", "tiny-lora", "tiny-qlora"],
               "holdout": ["tiny-holdout-qwen2-lora", "tiny-holdout-mistral-full"], "big": []}  # fmt: skip
TINY_GROUPS["all"] = TINY_GROUPS["acceptance"] = TINY_GROUPS["matrix"] + TINY_GROUPS["holdout"]

# The smallest loss chunk the planner searches for the tiny models (the application's,
# LOSS_CHUNK_FLOOR_TOKENS, is above their 128-144 positions): their search has chunks too.
TINY_LOSS_CHUNK_FLOOR_TOKENS = 32

# The acceptance targets: |error| median and worst.
TARGETS = {"peak": (0.03, 0.07), "step": (0.10, 0.20)}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument(
        "--out", type=Path, help="default: benchmarks/results/<date>-plan-accuracy.jsonl"
    )
    p.add_argument("--only", help="comma-separated configuration names")
    p.add_argument(
        "--group", help="comma-separated groups: matrix, holdout, big, all, acceptance "
                        "(default: the configurations of CONFIGS, as before groups existed)",
    )  # fmt: skip
    p.add_argument("--part", help="K/N: the K-th of N parts of equal estimated time")
    p.add_argument(
        "--time-limit", type=float,
        help="seconds for this whole invocation: a configuration whose estimate does not fit "
             "what is left is not started, and the one running is stopped at the limit",
    )  # fmt: skip
    p.add_argument("--list", action="store_true",
                   help="print the selection's parts and estimated seconds; run nothing")  # fmt: skip
    p.add_argument("--call-s", type=float, default=540,
                   help="with --list: the seconds one call may take (default 540)")  # fmt: skip
    p.add_argument("--summarize", nargs="+", type=Path, metavar="JSONL",
                   help="print the summary of these rows files and stop")  # fmt: skip
    p.add_argument("--steps", type=int, default=3, help="timed steps")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--run-id")
    p.add_argument("--tiny", action="store_true", help="tiny models on the CPU (smoke test)")
    p.add_argument("--timeout-s", type=int, default=1800, help="per configuration")
    p.add_argument(
        "--chunked-loss-tokens", type=int,
        help="the loss of traced and measured steps: the application's chunked loss over this "
             "many tokens at a time, as `memory: {chunked_loss_tokens: N}` fixes it (0: the "
             "model's own loss, full-sequence fp32 logits; default: unset, the planner "
             "chooses the chunk as the application does)",
    )  # fmt: skip
    p.add_argument(
        "--max-grad-norm", type=float, default=1.0,
        help="clipping of the measured steps, and the schedule the plan assumes (0: none; the "
             "steps then call optimizer.step_in_backward())",
    )  # fmt: skip
    p.add_argument(
        "--profiles", type=Path,
        help="write each configuration's model profile and hardware profile here "
             "(<config>.profile.json.gz, <config>.hardware.json), to re-plan offline",
    )  # fmt: skip
    p.add_argument(
        "--also",
        help="other knobs to run on the same trace after the plan's, with their predictions: "
             "'n_persist,n_buffer,n_swap,n_checkpoint[,host_threads];...' (in the row's "
             "'alternatives'; the prediction assumes the default host threads; they share the "
             "configuration's --timeout-s)",
    )  # fmt: skip
    p.add_argument(
        "--profile-search", action="store_true",
        help="search a second time under cProfile: its time and the top functions by "
             "cumulative time (the row's search_hot)",
    )  # fmt: skip
    p.add_argument(
        "--host-arena", choices=("huge", "plain"), default="huge",
        help="the engine's host arena (huge: its own, huge pages touched before pinning); "
             "plain: torch.empty, pinned by cudaHostRegister faulting in 4 KiB pages (fresh "
             "pages from the kernel are zero), for A/B runs",
    )  # fmt: skip
    p.add_argument(
        "--plan-repeats", type=int, default=1,
        help="plan this many times in the row's process (the later ones on a host whose "
             "memory the first trace already touched; in the row's plan_repeats)",
    )  # fmt: skip
    p.add_argument("--child", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def _plain_host_arena(nbytes: int):
    import torch

    return torch.empty(nbytes, dtype=torch.uint8)


def git_commit() -> str:
    if os.environ.get("COMMIT"):  # the suites name it: the device copy's .git is stale
        return os.environ["COMMIT"]
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=HERE.parent,
                             capture_output=True, text=True)  # fmt: skip
        return out.stdout.strip() or "unknown"
    except OSError:
        return "unknown"


def run_one(name: str, cfg: tuple, args: argparse.Namespace) -> dict:
    """In this process: budget, model, plan, steps; the row."""
    import torch

    from materialize import build_for_mode
    from workloads import LORA_RANK, MODEL_SHAPES, hf_config

    model_name, mode, budget_gib, batch, seq, workload = cfg
    if args.host_arena == "plain":  # an A/B against the engine's own arena
        import protrain.chunks.manager

        protrain.chunks.manager.host_arena = _plain_host_arena
    tiny = model_name.startswith("tiny")
    device = torch.device("cpu") if tiny else torch.device("cuda", 0)
    row = {
        "workload": workload, "config": name, "system": "protrain", "model": model_name,
        "mode": mode, "budget_gib": budget_gib, "batch": batch, "seq": seq, "status": "ok",
        "host_arena": args.host_arena,
        "run_id": args.run_id, "commit": git_commit(),
        "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF") or os.environ.get("PYTORCH_ALLOC_CONF"),
    }  # fmt: skip
    t_start = time.perf_counter()
    try:
        from protrain.plan import PlanRequest
        from protrain.plan.auto import profile_model
        from protrain.plan.closed_loop import check_plan
        from protrain.plan.host_budget import default_cpu_budget
        from protrain.plan.loss_chunk import LOSS_CHUNK_FLOOR_TOKENS, search_loss_chunks
        from protrain.profile.hardware import measure_hardware
        from protrain.profile.trace import hf_loss
        from protrain.train.planning import (
            PlanSettings,
            loss_chunk_of,
            plan_request,
            planner_loss,
        )

        fixed = args.chunked_loss_tokens
        row["loss_chunk"] = "planned" if fixed is None else "fixed" if fixed else "model"
        budget = int(budget_gib * _GIB) if not tiny else 1 << 40
        if device.type == "cuda":
            total = torch.cuda.get_device_properties(device).total_memory
            torch.cuda.set_per_process_memory_fraction(min(1.0, budget / total), device)
            row["gpu"] = torch.cuda.get_device_name(device)
        model = build_for_mode(hf_config(model_name), mode, LORA_RANK, device)
        model.train()
        vocab = MODEL_SHAPES[model_name]["vocab_size"]
        gen = torch.Generator().manual_seed(0)
        ids = torch.randint(vocab, (batch, seq), generator=gen).to(device)
        sample = {"input_ids": ids, "labels": ids}

        clip = args.max_grad_norm or None
        row["max_grad_norm"] = clip
        # The application's planner settings for what this script varies: the loss (the
        # planner's LossChunks where the chunk is not fixed, as `memory.auto` builds it).
        settings = PlanSettings(
            device=device, compute_dtype=torch.bfloat16 if device.type == "cuda" else torch.float32,
            request=PlanRequest(budget, clipping=clip is not None), chunked_loss_tokens=fixed or None,
            loss_chunk_floor_tokens=TINY_LOSS_CHUNK_FLOOR_TOKENS if tiny else LOSS_CHUNK_FLOOR_TOKENS,
        )  # fmt: skip
        request = plan_request(model, sample, settings)
        if fixed == 0:
            request = dataclasses.replace(request, loss_chunks=None, fixed_loss_chunk_tokens=None,
                                          loss_fn=hf_loss)  # fmt: skip

        host_budget = [None]

        def plan_once():
            """Hardware profile, trace, and the search as auto mode runs it (the chunk size
            searched too); with the times between them."""
            t0 = time.perf_counter()
            hw = measure_hardware(device)
            t1 = time.perf_counter()
            profile = profile_model(model, request, device=settings.device,
                                    compute_dtype=settings.compute_dtype)  # fmt: skip
            t2 = time.perf_counter()
            # auto mode's host budget when none is given, read after the trace as it does
            host_budget[0] = default_cpu_budget()
            asked = PlanRequest(gpu_budget_bytes=budget, cpu_budget_bytes=host_budget[0],
                                clipping=clip is not None)  # fmt: skip
            result, problem = search_loss_chunks(model, profile, hw, asked)
            return hw, profile, result, problem, (t0, t1, t2, time.perf_counter())

        hw, profile, result, problem, (t0, t1, t2, t3) = plan_once()
        plan = result.plan
        # the steps' loss: the plan's chunk where the planner chose it, else the user's
        chunk = None if fixed == 0 else loss_chunk_of(plan, settings)
        loss_fn = hf_loss if fixed == 0 else planner_loss(device, chunk)
        if row["loss_chunk"] == "planned" and not plan.loss_planned:
            row["loss_chunk"] = "whole"  # the head cannot be chunked: the whole logits
        row.update(chunked_loss_tokens=chunk,
                   loss_chunk_traced=profile.loss_chunk_tokens if plan.loss_planned else chunk)  # fmt: skip
        row.update(
            hardware_s=round(t1 - t0, 2), trace_s=round(t2 - t1, 2), search_s=round(t3 - t2, 4),
            plan_s=round(t3 - t0, 2), search_work=result.work, plan=plan.knobs,
            cpu_budget_gib=host_budget[0] and round(host_budget[0] / _GIB, 2),
            predicted_host_gib=round(plan.predicted_host_bytes / _GIB, 2),
            chunk_size_bytes=plan.chunk_size_bytes,
            predicted_peak_gib=round(plan.predicted_peak_bytes / _GIB, 3),
            predicted_step_s=round(plan.predicted_step_s, 4),
            predicted_memory_terms_gib={k: round(v / _GIB, 3) for k, v in plan.memory_terms.items()},
            predicted_time_terms={k: round(v, 4) for k, v in plan.time_terms.items()},
            trace_n_persist=profile.trace_n_persist, n_chunks=plan.n_chunks,
            traced_step_s=round(profile.step_s, 4), trace_phases_s=profile.trace_phases_s,
            trace_wrap_build_s=profile.wrap_build_s,
            trace_notes=profile.notes,
            free_fwd_bwd_s=profile.free_fwd_bwd_s and round(profile.free_fwd_bwd_s, 4),
            loss_forward_s=round(profile.loss_forward_s, 4),
            free_loss_forward_s=profile.free_loss_forward_s and round(profile.free_loss_forward_s, 4),
            free_keep_fwd_bwd_s=profile.free_keep_fwd_bwd_s and round(profile.free_keep_fwd_bwd_s, 4),
            hardware={k: v for k, v in hw.to_dict().items() if k.endswith("_per_s")},
        )  # fmt: skip
        print(plan, file=sys.stderr)
        repeats = []
        for _ in range(args.plan_repeats - 1):  # the same plan again, in this warm process
            _, again, res, _, (r0, r1, r2, r3) = plan_once()
            repeats.append({
                "plan_s": round(r3 - r0, 2), "trace_s": round(r2 - r1, 2),
                "trace_phases_s": again.trace_phases_s, "trace_wrap_build_s": again.wrap_build_s,
                "plan": res.plan.knobs,
            })  # fmt: skip
        if repeats:
            row["plan_repeats"] = repeats
        if args.profiles:
            import gzip

            args.profiles.mkdir(parents=True, exist_ok=True)
            with gzip.open(args.profiles / f"{name}.profile.json.gz", "wt") as f:
                f.write(profile.to_json())
            (args.profiles / f"{name}.hardware.json").write_text(json.dumps(hw.to_dict()))

        row.update(_run_plan(model, plan.knobs, plan.chunk_size_bytes, sample, loss_fn, clip,
                             device, args, t_start=t_start))  # fmt: skip
        m = row.pop("_measured")
        check = check_plan(plan, problem, measured_peak_bytes=m.peak_reserved_bytes,
                           measured_step_s=m.step_s,
                           measured_allocated_bytes=m.peak_allocated_bytes if device.type == "cuda" else None)  # fmt: skip
        row.update(
            peak_error=round(check.peak_error, 4), step_error=round(check.step_error, 4),
            closed_loop_corrected=check.corrected.knobs if check.corrected else None,
        )  # fmt: skip
        # Other knobs on the same trace and hardware profile: is the model's ranking right?
        alternatives = []
        for knobs, threads in _parse_also(args.also):
            alt = {"plan": knobs, "host_threads": threads}
            try:
                e = problem.evaluate(**knobs)
                alt.update(predicted_peak_gib=round(e["peak_bytes"] / _GIB, 3),
                           predicted_step_s=round(e["step_s"], 4),
                           predicted_time_terms={k: round(v, 4) for k, v in e["time_terms"].items()})  # fmt: skip
                alt.update(_run_plan(model, knobs, plan.chunk_size_bytes, sample, loss_fn, clip,
                                     device, args, host_threads=threads))  # fmt: skip
                ma = alt.pop("_measured")
                alt["step_error"] = round((e["step_s"] - ma.step_s) / ma.step_s, 4)
                alt["peak_error"] = round(
                    (e["peak_bytes"] - ma.peak_reserved_bytes) / ma.peak_reserved_bytes, 4
                )
            except Exception as exc:  # an alternative that fails is recorded, not fatal
                traceback.print_exc()
                alt["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
            alternatives.append(alt)
        if alternatives:
            row["alternatives"] = alternatives
        if args.profile_search:  # where the search's time goes on this host: once more, profiled
            asked = PlanRequest(gpu_budget_bytes=budget, cpu_budget_bytes=host_budget[0],
                                clipping=clip is not None)  # fmt: skip
            row["search_hot"] = _profiled(lambda: search_loss_chunks(model, profile, hw, asked))
    except Exception as e:  # one row per failure; the traceback goes to stderr
        traceback.print_exc()
        text = f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"
        from protrain.plan import NoPlanFits

        oom = "out of memory" in text.lower()
        status = "oom" if oom else "no_plan" if isinstance(e, NoPlanFits) else "error"
        row.update(status=status, error=text[:1000])
    return row


def _profiled(fn) -> dict:
    """``fn()`` under cProfile: its seconds, and the 15 functions of most cumulative time."""
    import cProfile
    import pstats

    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.runcall(fn)
    seconds = time.perf_counter() - t0
    stats = pstats.Stats(prof)
    # stats: (file, line, name) -> (primitive calls, calls, own s, cumulative s, callers)
    rows = sorted(stats.stats.items(), key=lambda kv: -kv[1][3])[:15]
    return {
        "seconds_profiled": round(seconds, 4),
        "top": [[f"{Path(f).name}:{line}({name})", v[1], round(v[2], 4), round(v[3], 4)]
                for (f, line, name), v in rows],
    }  # fmt: skip


def _parse_also(text: str | None) -> list[tuple[dict, int | None]]:
    """``--also`` as (knobs, host threads or None) per alternative; ValueError names the bad
    item (``main`` parses it before any configuration runs)."""
    out = []
    for item in filter(None, (text or "").split(";")):
        try:
            v = [int(x) for x in item.split(",")]
        except ValueError:
            v = []
        if len(v) not in (4, 5) or min(v) < 0:
            raise ValueError(
                f"--also {item!r}: want n_persist,n_buffer,n_swap,n_checkpoint[,host_threads], "
                "non-negative integers, alternatives separated by ';'"
            )
        out.append((dict(zip(("n_persist", "n_buffer", "n_swap", "n_checkpoint"), v[:4])),
                    v[4] if len(v) == 5 else None))  # fmt: skip
    return out


def _run_plan(model, knobs, chunk_size_bytes, sample, loss_fn, clip, device, args, *,
              host_threads=None, t_start=None) -> dict:  # fmt: skip
    """Wrap ``model`` with ``knobs``, run the warm-up and timed steps, unwrap; the measured
    fields of a row, and the measurement itself under ``_measured``."""
    import torch

    import protrain
    from protrain.activations import apply_activation_knobs
    from protrain.profile.measure import measure_steps
    from systems.protrain_engine import StepCounters

    out: dict = {}
    _empty_cache(device)  # a failed run before may have left its blocks cached
    model, optimizer, _ = protrain.wrap(
        model, n_persist=knobs["n_persist"], n_buffer=knobs["n_buffer"] or None, device=device,
        lr=1e-5, compute_dtype=torch.bfloat16 if device.type == "cuda" else torch.float32,
        chunk_size_bytes=chunk_size_bytes, host_threads=host_threads,
    )  # fmt: skip
    out["wrap_build_s"] = dict(model._protrain_engine.manager.build_s)
    handle = None
    try:
        handle = apply_activation_knobs(model, knobs["n_swap"], knobs["n_checkpoint"],
                                        device=device)  # fmt: skip

        def step():
            if clip is None:  # the host AdamW starts inside backward
                optimizer.step_in_backward()
            loss_fn(model, sample).backward()
            if clip is not None:
                optimizer.clip_grad_norm_(clip)
            optimizer.step()
            optimizer.zero_grad()

        if device.type == "cuda":
            torch.cuda.synchronize(device)
            if t_start is not None:
                out["time_to_first_step_s"] = round(time.perf_counter() - t_start, 1)
        counters = StepCounters(model, optimizer)
        calls = [0]

        def counted_step():
            if calls[0] == args.warmup:  # the timed steps begin: count from here
                counters()
            calls[0] += 1
            step()

        m = measure_steps(model, counted_step, steps=args.steps, warmup=args.warmup, device=device)
        b, s = sample["input_ids"].shape
        out.update(
            step_s=round(m.step_s, 4), tokens_per_s=round(b * s / m.step_s, 1),
            peak_alloc_gib=round(m.peak_allocated_bytes / _GIB, 3),
            peak_reserved_gib=round(m.peak_reserved_bytes / _GIB, 3), _measured=m,
        )  # fmt: skip
        # The engine's counters over the timed steps only, every copy counted (gathers,
        # seconds waited on copies and on the host optimizer, host AdamW seconds), for
        # diagnosing step errors (warm-up steps excluded: the first has no update before it).
        out["engine_stats_per_step"] = {k: round(v / args.steps, 4) for k, v in counters().items()}
    finally:
        if handle is not None:
            handle.remove()
        protrain.close(model)  # the model is unwrapped for the next run, whatever happened
        _empty_cache(device)  # the next run's reserved peak starts from an empty cache
    return out


def _empty_cache(device) -> None:
    if device.type == "cuda":
        import gc

        import torch

        gc.collect()
        torch.cuda.empty_cache()


# [Note: estimated seconds] A configuration's child process costs its start (interpreter,
# torch and transformers imports: CHILD_START_S), time_to_first_step_s (model build, plan,
# wrap; counted from the row's start) and its warm-up and timed steps. An earlier row gives
# these (or its own wall_s where it has one); a configuration never run borrows the nearest
# row of the same mode on PROXY's model, its trace and steps scaled by the tokens a step, times UNSEEN_MARGIN (offload at a smaller budget is slower).
CHILD_START_S = 15.0
UNSEEN_MARGIN = 1.3
DEFAULT_ESTIMATE_S = 120.0
PROXY = {"qwen7b": "llama8b", "mistral7b": "llama8b"}


def earlier_rows(results: Path = HERE / "results") -> dict[str, dict]:
    """The last row that ran, per configuration, of every plan-accuracy file in `results`."""
    last: dict[str, dict] = {}
    for path in sorted(results.glob("*plan-accuracy*.jsonl")):
        for line in path.read_text().splitlines():
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue
            if row.get("status") == "ok" and row.get("time_to_first_step_s") and row.get("step_s"):
                last[row["config"]] = row
    return last


def estimate_s(name: str, cfg: tuple, earlier: dict[str, dict], n_steps: int) -> float:
    """Seconds the configuration's child should take ([Note: estimated seconds])."""
    model, mode, budget, batch, seq, _ = cfg
    row = earlier.get(name)
    if row is not None:
        if row.get("wall_s"):
            done = row.get("steps_run", n_steps)
            return row["wall_s"] + (n_steps - done) * row["step_s"]
        return CHILD_START_S + row["time_to_first_step_s"] + n_steps * row["step_s"]
    proxy = PROXY.get(model, model)
    same = [r for r in earlier.values() if r.get("model") == proxy and r.get("mode") == mode]
    if not same:
        return DEFAULT_ESTIMATE_S
    tokens = batch * seq
    # nearest in tokens by ratio (twice as many and half as many are as far), then in budget
    near = min(same, key=lambda r: (abs(math.log(r["batch"] * r["seq"] / tokens)),
                                    abs(r["budget_gib"] - budget)))  # fmt: skip
    scale = tokens / (near["batch"] * near["seq"])
    plan_s = near.get("plan_s") or 0.0
    base = near["time_to_first_step_s"] - plan_s + (plan_s + n_steps * near["step_s"]) * scale
    return CHILD_START_S + UNSEEN_MARGIN * base


def split_parts(names: list[str], seconds: dict[str, float], n: int) -> list[list[str]]:
    """`names` in `n` parts of about equal estimated time (longest first into the lightest
    part), each in the order given."""
    loads = [0.0] * n
    owner: dict[str, int] = {}
    for name in sorted(names, key=lambda x: -seconds[x]):
        k = loads.index(min(loads))
        owner[name] = k
        loads[k] += seconds[name]
    return [[x for x in names if owner[x] == k] for k in range(n)]


def parse_part(text: str) -> tuple[int, int]:
    try:
        k, n = (int(v) for v in text.split("/"))
    except ValueError:
        k = n = 0
    if not 1 <= k <= n:
        raise ValueError(f"--part {text!r}: want K/N with 1 <= K <= N, e.g. 2/5")
    return k, n


def select(args: argparse.Namespace, configs: dict) -> list[str]:
    """The configurations named by --only or --group (default: CONFIGS); ValueError names
    an unknown one."""
    if args.only:
        names = args.only.split(",")
        unknown = [n for n in names if n not in configs]
        if unknown:
            raise ValueError(f"unknown configurations {unknown}; known: {sorted(configs)}")
        return names
    groups = TINY_GROUPS if args.tiny else GROUPS
    if not args.group:
        return list(TINY if args.tiny else CONFIGS)
    names: list[str] = []
    for group in args.group.split(","):
        if group not in groups:
            raise ValueError(f"--group {group!r}: known groups are {', '.join(groups)}")
        names += [n for n in groups[group] if n not in names]
    return names


def _pct(values: list[float]) -> str:
    return f"median {100 * statistics.median(values):.1f}%, worst {100 * max(values):.1f}%"


def acceptance(rows: list[dict]) -> list[str]:
    """The acceptance targets over `rows` (the last row per configuration and GPU), per GPU."""
    last: dict[tuple, dict] = {}
    for r in rows:
        last[(r.get("config"), r.get("gpu"))] = r
    lines = []
    for gpu in sorted({g for _, g in last}, key=str):
        these = [r for (_, g), r in last.items() if g == gpu]
        ok = [r for r in these if r.get("status") == "ok"]
        held = [r for r in ok if r.get("workload") == "holdout"]
        line = (f"{gpu or '(rows without a gpu field)'}: {len(ok)} of {len(these)} configurations ran "
                f"({len(held)} held out)")  # fmt: skip
        for status in ("oom", "no_plan", "error"):
            bad = [r["config"] for r in these if r.get("status") == status]
            if bad:
                line += f"; {status}: {', '.join(bad)}"
        if ok:
            verdict = []
            for key, (med, worst) in TARGETS.items():
                errors = [abs(r[f"{key}_error"]) for r in ok]
                meets = statistics.median(errors) <= med and max(errors) <= worst
                verdict.append(f"{key} error {_pct(errors)} "
                               f"({'meets' if meets else 'misses'} {100 * med:.0f}%/{100 * worst:.0f}%)")  # fmt: skip
            line += "; " + "; ".join(verdict)
            if held:
                line += (f"; held out: peak {_pct([abs(r['peak_error']) for r in held])}, "
                         f"step {_pct([abs(r['step_error']) for r in held])}")  # fmt: skip
        lines.append(line)
    return lines


def summarize(rows: list[dict]) -> str:
    ok = [r for r in rows if r.get("status") == "ok"]
    lines = [f"{len(ok)} of {len(rows)} configurations ran; "
             f"{sum(r.get('status') == 'oom' for r in rows)} ran out of memory"]  # fmt: skip
    if ok:
        peak = [abs(r["peak_error"]) for r in ok]
        step = [abs(r["step_error"]) for r in ok]
        lines.append(
            f"peak error vs reserved: median {100 * statistics.median(peak):.1f}%, worst "
            f"{100 * max(peak):.1f}%; step error: median {100 * statistics.median(step):.1f}%, "
            f"worst {100 * max(step):.1f}%; search: worst "
            f"{max(r['search_s'] for r in ok):.3f} s; plan (hardware + trace + search): worst "
            f"{max(r['plan_s'] for r in ok):.1f} s"
        )
    no_plan = [r["config"] for r in rows if r.get("status") == "no_plan"]
    if no_plan:
        lines.append(f"no plan found (does any plan fit these budgets?): {', '.join(no_plan)}")
    return "\n".join(lines + acceptance(rows))


def main(argv=None) -> int:
    args = parse_args(argv)
    configs = TINY if args.tiny else ALL_CONFIGS
    if args.child:
        print(json.dumps(run_one(args.child, configs[args.child], args)))
        return 0
    if args.summarize:
        rows = [json.loads(line) for path in args.summarize
                for line in path.read_text().splitlines() if line.strip()]  # fmt: skip
        print(summarize(rows))
        return 0
    try:
        _parse_also(args.also)
        names = select(args, configs)
        part = parse_part(args.part) if args.part else None
    except ValueError as e:
        print(e, file=sys.stderr)
        return 2
    earlier = earlier_rows()
    n_steps = args.steps + args.warmup
    seconds = {n: estimate_s(n, configs[n], earlier, n_steps) for n in names}
    if args.list:
        _print_parts(names, seconds, part, args.call_s, earlier)
        return 0
    if part:
        names = split_parts(names, seconds, part[1])[part[0] - 1]
    # As the application does (protrain.runtime.allocator): the children inherit it.
    from protrain.runtime.allocator import prefer_expandable_segments

    prefer_expandable_segments()
    run_id = args.run_id or datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%MZ")
    day = datetime.now(timezone.utc).strftime("%Y-%m-%d")
    out = args.out or HERE / "results" / f"{day}-plan-accuracy{'-tiny' if args.tiny else ''}.jsonl"
    rows, skipped = [], []
    t_call = time.perf_counter()
    gpu = None if args.tiny else gpu_name()  # for rows the child never wrote
    for name in names:
        timeout = args.timeout_s
        if args.time_limit:
            left = args.time_limit - (time.perf_counter() - t_call)
            if seconds[name] > left:  # not started: it would not end in time
                skipped.append(name)
                print(f"skipped (time): {name}, estimated {seconds[name]:.0f} s, "
                      f"{max(left, 0):.0f} s left", file=sys.stderr, flush=True)  # fmt: skip
                continue
            timeout = max(1, min(timeout, int(left)))
        cmd = [sys.executable, __file__, "--child", name, "--run-id", run_id,
               "--steps", str(args.steps), "--warmup", str(args.warmup),
               "--max-grad-norm", str(args.max_grad_norm)]  # fmt: skip
        if args.chunked_loss_tokens is not None:  # fixed by the user; unset: the planner's
            cmd += ["--chunked-loss-tokens", str(args.chunked_loss_tokens)]
        if args.also:
            cmd += ["--also", args.also]
        if args.profile_search:
            cmd.append("--profile-search")
        cmd += ["--host-arena", args.host_arena, "--plan-repeats", str(args.plan_repeats)]
        if args.tiny:
            cmd.append("--tiny")
        if args.profiles:
            cmd += ["--profiles", str(args.profiles)]
        busy, quiet_wait = wait_quiet_host()
        t0 = time.perf_counter()
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
            last = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else ""
            row = json.loads(last) if last.startswith("{") else {
                "config": name, "status": "error", "run_id": run_id,
                "error": f"exit status {proc.returncode} without a row (a negative status: "
                         f"killed by that signal); last line of stderr: "
                         f"{(proc.stderr.strip().splitlines() or ['none'])[-1][:400]}",
            }  # fmt: skip
            if proc.returncode != 0 or row.get("status") != "ok":
                sys.stderr.write(proc.stderr[-4000:])
        except subprocess.TimeoutExpired:
            row = {"config": name, "status": "error", "run_id": run_id,
                   "error": f"timeout after {timeout} s"}  # fmt: skip
        if gpu and "gpu" not in row:
            row["gpu"] = gpu
        # the child's whole life (start, imports, teardown): later estimates read it
        row.update(wall_s=round(time.perf_counter() - t0, 1), steps_run=n_steps,
                   estimated_s=round(seconds[name], 1), host_busy_before=busy,
                   quiet_wait_s=quiet_wait)  # fmt: skip
        rows.append(row)
        print(json.dumps(row), flush=True)
        out.parent.mkdir(parents=True, exist_ok=True)
        with out.open("a") as f:
            f.write(json.dumps(row) + "\n")
    print(summarize(rows), file=sys.stderr)
    if skipped:
        print(f"not started (time): --only {','.join(skipped)}", file=sys.stderr)
    print(f"elapsed {time.perf_counter() - t_call:.0f} s", file=sys.stderr)
    return 0


def _cpu_times() -> tuple[int, int] | None:
    """(busy, total) jiffies of all CPUs since boot, from /proc/stat (None elsewhere)."""
    try:
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    idle = v[3] + (v[4] if len(v) > 4 else 0)  # idle + iowait
    return sum(v) - idle, sum(v)


# On H100 and H200 hosts the 512-token 3B LoRA step's free-running trace took 0.20 s in one child
# and 0.32-0.35 s in matrix children, whose whole early life was slower (wrap 1.0-1.25 s
# against 0.81, time to first step 23-29 s against 18.6), while its measured steps later in
# the same child were not. A child starts once the host's CPUs are quiet again after the
# last one (its teardown: pinned memory unmapped, the driver's context released), and the
# row records how busy they were and how long it waited.
QUIET_BUSY = 0.10
QUIET_MAX_S = 20.0


def wait_quiet_host(
    busy_below: float = QUIET_BUSY, max_s: float = QUIET_MAX_S, window_s: float = 0.5
) -> tuple[float | None, float]:
    """Wait until the CPUs' busy share over ``window_s`` is under ``busy_below`` (at most
    ``max_s``); (the last busy share read, seconds waited)."""
    t0 = time.perf_counter()
    share = None
    while True:
        a = _cpu_times()
        if a is None:
            return None, 0.0
        time.sleep(window_s)
        b = _cpu_times()
        share = (b[0] - a[0]) / max(b[1] - a[1], 1)
        waited = time.perf_counter() - t0
        if share < busy_below or waited >= max_s:
            return round(share, 3), round(waited, 1)


def gpu_name() -> str | None:
    """The first visible GPU's name from nvidia-smi (the parent starts no CUDA context: its
    memory would count against the children's budgets); None where there is none."""
    index = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0] or "0"
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader", "-i", index],
                             capture_output=True, text=True, timeout=30)  # fmt: skip
    except (OSError, subprocess.TimeoutExpired):
        return None
    if out.returncode != 0:
        return None
    return out.stdout.strip() or None


def _print_parts(names, seconds, part, call_s, earlier) -> None:
    """--list: each configuration's estimate and where it comes from, and the parts."""
    total = sum(seconds.values())
    n = part[1] if part else max(1, -(-int(total) // int(call_s)))
    while True:  # the fewest parts whose estimates each fit one call (unless --part names N)
        parts = split_parts(names, seconds, n)
        if part or max(sum(seconds[x] for x in p) for p in parts) <= call_s or n >= len(names):
            break
        n += 1
    for name in names:
        source = "earlier row" if name in earlier else "proxy (never run)"
        print(f"{name:40s} {seconds[name]:6.0f} s  {source}")
    print(f"total {total:.0f} s ({total / 60:.1f} min) in {n} parts:")
    for k, p in enumerate(parts, 1):
        print(f"  --part {k}/{n}: {sum(seconds[x] for x in p):4.0f} s  {','.join(p)}")


if __name__ == "__main__":
    sys.exit(main())
