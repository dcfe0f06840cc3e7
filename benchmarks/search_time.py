"""Search time at scale (issue 6: "well under a second for models with hundreds of chunks and
a hundred blocks"), on the machine this runs on: a 100-layer tiny Llama traced on the CPU with
small chunks (about 250 of them), then one search at the traced chunk size and the search
over candidate chunk sizes that auto mode runs (``plan.chunk_size.search_chunk_sizes``).
One JSON row to ``--out``; nothing here asserts a time::

    python benchmarks/search_time.py --out benchmarks/results/search-time.jsonl
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests" / "profile"))
sys.path.insert(0, str(ROOT / "tests" / "plan"))


def main(argv: list[str] | None = None) -> int:
    import plan_synthetic as syn
    import tiny_llama

    from protrain.plan import PlanProblem, search
    from protrain.plan.chunk_size import chunk_size_candidates, search_chunk_sizes
    from protrain.profile.trace import trace_model

    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--layers", type=int, default=100)
    p.add_argument("--chunk-bytes", type=int, default=70_000)
    p.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "search-time.jsonl"))
    args = p.parse_args(argv)
    model = tiny_llama.build(layers=args.layers)
    profile = trace_model(
        model, tiny_llama.batch(), device="cpu", n_persist=0, chunk_size_bytes=args.chunk_bytes
    )
    hw = syn.hardware("cuda")  # a GPU's rates: the search over overlapping terms
    budget = 2 * sum(profile.chunks.used_bytes)
    t0 = time.perf_counter()
    single = search(PlanProblem(profile, hw, gpu_budget_bytes=budget))
    t1 = time.perf_counter()
    over_sizes, _ = search_chunk_sizes(model, profile, hw, gpu_budget_bytes=budget)
    t2 = time.perf_counter()
    row = {
        "kind": "search_time",
        "blocks": args.layers,
        "chunks_traced": profile.chunks.n_chunks,
        "candidate_sizes": len(chunk_size_candidates(model, profile)),
        "single_search_s": round(t1 - t0, 3),
        "single_work": single.work,
        "chunk_size_search_s": round(t2 - t1, 3),
        "chunk_size_search_work": over_sizes.work,
        "chosen_chunk_bytes": over_sizes.plan.chunk_size_bytes,
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs",
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%MZ"),
    }
    print(json.dumps(row))
    with open(args.out, "a") as f:
        f.write(json.dumps(row) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
