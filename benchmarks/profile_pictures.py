"""The `protrain profile` pictures of benchmark workloads: one traced step of a workload's
model at its batch and budget, drawn as HTML (hover for figures) and PNG.

    python benchmarks/profile_pictures.py                      # full-3b and lora-14b, GPU
    python benchmarks/profile_pictures.py --shape tiny --device cpu --out-dir /tmp/pictures

The path is `protrain profile`'s from the planning inputs on: the model (random weights
of the workload's shape, built as benchmarks/run.py builds it: on the meta device, filled
on the GPU, kept on the host), a batch of random tokens at the workload's shape and the
planner settings the app derives from a config (bf16 on CUDA, the workload's budget,
clipping), then `protrain.train.planning.profile_memory` (the trace the planner reads) and
`protrain.profile.timeline` with the budget and this machine's hardware profile (cached;
measured on first use). Writes `<stem>.html`, `<stem>.png` and the profile as
`<stem>.profile.json` (to redraw without a GPU), stem `<date>-profile-<workload>` (with
`-tiny` for `--shape tiny`), into `--out-dir` (default benchmarks/results).

`--shape tiny` swaps in the tiny model of the same mode (full or LoRA) at 2 x 64 tokens, with
small chunks and a budget of a few MiB so that chunks are offloaded: a check of the path on
the CPU, not a measurement.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

from protrain.runtime.allocator import prefer_expandable_segments

prefer_expandable_segments()  # as the app does, before anything touches CUDA

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))

from materialize import build_for_mode  # noqa: E402
from protrain.knobs import Knobs  # noqa: E402
from protrain.plan import PlanRequest  # noqa: E402
from protrain.profile.hardware import measure_hardware  # noqa: E402
from protrain.profile.timeline import (  # noqa: E402
    build_picture,
    write_timeline_html,
    write_timeline_png,
)
from protrain.train.planning import PlanSettings, profile_memory  # noqa: E402
from workloads import LORA_RANK, MODEL_SHAPES, WORKLOADS, hf_config  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
_GIB = 2**30
PICTURED = ("full-3b", "lora-14b")
# --shape tiny: small enough for a CPU, chunked finely enough that the trace offloads
TINY = dict(batch=2, seq=64, budget_gib=2 / 1024, chunk_mib=1 / 16)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--workload", action="append", choices=sorted(WORKLOADS),
                   help=f"repeatable (default: {', '.join(PICTURED)})")  # fmt: skip
    p.add_argument("--shape", choices=["workload", "tiny"], default="workload",
                   help="the workload's model shape, or the tiny one (a CPU check)")  # fmt: skip
    p.add_argument("--device", help="cuda (default when there is one) or cpu")
    p.add_argument("--batch", type=int, help="default: the workload's first batch size")
    p.add_argument("--seq", type=int, help="default: the workload's sequence length")
    p.add_argument("--budget-gib", type=float, help="default: the workload's budget")
    p.add_argument("--chunk-mib", type=float, help="default: the engine's choice")
    p.add_argument("--chunked-loss-tokens", type=int,
                   help="the app's memory.chunked_loss_tokens (default: the model's loss)")  # fmt: skip
    p.add_argument("--no-clipping", action="store_true",
                   help="the host AdamW lane of a run without max_grad_norm")  # fmt: skip
    p.add_argument("--out-dir", type=Path, default=REPO / "benchmarks" / "results")
    return p.parse_args(argv)


def picture(name: str, args: argparse.Namespace, device: torch.device) -> dict:
    """Trace one workload and write its pictures; a line of what was written."""
    workload = WORKLOADS[name]
    tiny = args.shape == "tiny"
    model_name = "tiny" if tiny else workload.model
    batch_size = args.batch or (TINY["batch"] if tiny else workload.batches[0])
    seq = args.seq or (TINY["seq"] if tiny else workload.seq)
    budget_gib = args.budget_gib or (TINY["budget_gib"] if tiny else workload.budget_gib)
    chunk_mib = args.chunk_mib or (TINY["chunk_mib"] if tiny else None)
    lora_rank = LORA_RANK if workload.mode in ("lora", "qlora") else None

    t0 = time.perf_counter()
    model = build_for_mode(hf_config(model_name), workload.mode, lora_rank, device)
    model.train()
    vocab = MODEL_SHAPES[model_name]["vocab_size"]
    ids = torch.randint(vocab, (batch_size, seq), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "labels": ids.clone()}
    request = PlanRequest(
        int(budget_gib * _GIB),
        knobs=Knobs(chunk_size_bytes=int(chunk_mib * 2**20) if chunk_mib else None),
        clipping=not args.no_clipping,
    )
    settings = PlanSettings(
        device=device,
        compute_dtype=torch.bfloat16 if device.type == "cuda" else torch.float32,
        request=request,
        chunked_loss_tokens=args.chunked_loss_tokens,
    )
    built_s = time.perf_counter() - t0
    profile = profile_memory(model, batch, settings)
    hardware = measure_hardware(device)

    stem = f"{datetime.now(timezone.utc):%Y-%m-%d}-profile-{name}" + ("-tiny" if tiny else "")
    args.out_dir.mkdir(parents=True, exist_ok=True)
    base = args.out_dir / stem
    budget = request.gpu_budget_bytes
    size = f"{budget_gib:g} GiB" if budget_gib >= 1 else f"{budget_gib * 1024:g} MiB"
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    title = (
        f"{name}: {model_name} {workload.mode}, batch {batch_size} x {seq}, budget {size}, {where}"
    )
    kw = dict(budget_bytes=budget, hardware=hardware, clipping=request.clipping)
    html = write_timeline_html(profile, base.with_suffix(".html"), title=title, **kw)
    png = write_timeline_png(profile, base.with_suffix(".png"), **kw)
    base.with_suffix(".profile.json").write_text(profile.to_json())
    peak = build_picture(profile, **kw).peak
    return {
        "workload": name,
        "model": model_name,
        "html": str(html),
        "png": str(png),
        "build_s": round(built_s, 2),
        "trace_s": round(profile.trace_s, 2),
        "traced_step_s": round(profile.step_s, 4),
        "trace_n_persist": profile.trace_n_persist,
        "n_chunks": profile.chunks.n_chunks,
        "picture_peak_gib": round(peak.total / _GIB, 3),
        "peak_in": peak.what,
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    for name in args.workload or PICTURED:
        print(json.dumps(picture(name, args, device)), flush=True)
        gc.collect()  # the model just traced (tens of GB on the host) before the next is built
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
