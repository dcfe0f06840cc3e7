"""Re-predict measured plans offline: the step time and peak that the current models give
for the knobs a plan-accuracy row ran, from the profiles that row kept.

A row of ``plan_accuracy.py`` holds the knobs it ran and what it measured; ``--profiles``
kept its trace and hardware profile. This rebuilds the row's model on the meta device
(the parameter shapes the chunk-size search re-reads), re-chunks the profile to the row's
chunk size (``chunk_size_bytes``; the oldest rows lack it: the candidate size with
the row's chunk count and the nearest prediction), and evaluates the knobs, and those of the row's alternatives, with
the memory and runtime models of this checkout. So a change to the models can be judged
against every measurement already made, without the GPU::

    python benchmarks/repredict.py --rows results/2026-11-22_h100_plan-accuracy-a-0934z.jsonl \
        --profiles /tmp/profiles

4-bit rows (``qlora``) are skipped: their stand-in takes a quantization on the CPU
(``search_time.py --four-bit``).
"""

from __future__ import annotations

import argparse
import gzip
import json
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))


def _model(shape: str, mode: str):
    import torch

    from materialize import build_on_meta
    from workloads import LORA_RANK, hf_config

    lora = mode == "lora"
    return build_on_meta(hf_config(shape), torch.bfloat16 if lora else torch.float32,
                         LORA_RANK if lora else None)  # fmt: skip


def _problem(row: dict, profiles: Path, models: dict):
    """The row's PlanProblem at its chunk size, or None (no profile, 4-bit)."""
    from plan_accuracy import ALL_CONFIGS
    from protrain.plan.chunk_size import chunk_size_candidates, rechunk
    from protrain.plan.loss_chunk import at_loss_chunk
    from protrain.plan.search import PlanProblem
    from protrain.profile.hardware import HardwareProfile
    from protrain.profile.trace import ModelProfile

    name = row["config"]
    path = profiles / f"{name}.profile.json.gz"
    if name not in ALL_CONFIGS or not path.exists():
        return None
    shape, mode = ALL_CONFIGS[name][:2]
    if mode == "qlora":
        return None
    with gzip.open(path, "rt") as f:
        profile = ModelProfile.from_json(f.read())
    if profile.loss_chunk_candidates:  # the planner's loss: the chunk the row's steps ran
        profile = at_loss_chunk(profile, row.get("chunked_loss_tokens"))
    hw = HardwareProfile(**json.loads((profiles / f"{name}.hardware.json").read_text()))
    key = (shape, mode)
    if key not in models:
        models[key] = _model(shape, mode)
    model = models[key]

    def problem_at(size: int) -> PlanProblem:
        return PlanProblem(
            rechunk(profile, model, size), hw,
            gpu_budget_bytes=int(row["budget_gib"] * (1 << 30)),
            clipping=row.get("max_grad_norm") is not None,
        )  # fmt: skip

    if row.get("chunk_size_bytes"):
        return problem_at(row["chunk_size_bytes"])
    # The oldest rows lack the size: of the candidates with the row's chunk count, the
    # one whose prediction (by this checkout's models) is nearest the row's own. That pulls
    # "now" toward "row": such rows are marked "inferred" and say little about a model change.
    found = [problem_at(s) for s in chunk_size_candidates(model, profile)]
    found = [q for q in found if q.memory.n_chunks == row["n_chunks"]]
    if not found:
        return None
    return min(
        found, key=lambda q: abs(q.evaluate(**row["plan"])["step_s"] - row["predicted_step_s"])
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--rows", nargs="+", required=True, help="plan_accuracy.py result files")
    p.add_argument("--profiles", type=Path, required=True, help="their kept profiles")
    args = p.parse_args(argv)
    models: dict = {}
    old, new, peaks = [], [], []
    print(
        f"{'configuration':30s} {'knobs':16s} {'measured s':>10s} {'row':>8s} {'now':>8s}  {'peak now':>8s}"
    )
    for file in args.rows:
        with open(file) as f:
            rows = [json.loads(line) for line in f]
        for row in rows:
            if row.get("status") != "ok":
                continue
            problem = _problem(row, args.profiles, models)
            if problem is None:
                continue
            runs = [row] + [a for a in row.get("alternatives", []) if "step_s" in a]
            for run in runs:
                e = problem.evaluate(**run["plan"])
                err = (e["step_s"] - run["step_s"]) / run["step_s"]
                peak = (e["peak_bytes"] / (1 << 30) - run["peak_reserved_gib"]) / run[
                    "peak_reserved_gib"
                ]
                if run is row:
                    old.append(abs(row["step_error"]))
                    new.append(abs(err))
                    peaks.append(abs(peak))
                knobs = "/".join(str(v) for v in run["plan"].values())
                size = "" if row.get("chunk_size_bytes") else "  (chunk size inferred)"
                print(f"{row['config'][:30]:30s} {knobs:16s} {run['step_s']:10.3f} "
                      f"{100 * run['step_error']:+7.1f}% {100 * err:+7.1f}%  {100 * peak:+7.1f}%"
                      f"{size}")  # fmt: skip
    if new:
        print(f"{len(new)} rows: step error median {100 * statistics.median(old):.1f}% as "
              f"measured, {100 * statistics.median(new):.1f}% now (worst {100 * max(new):.1f}%); "
              f"peak error now median {100 * statistics.median(peaks):.1f}%, worst "
              f"{100 * max(peaks):.1f}%")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
