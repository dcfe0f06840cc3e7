"""Turn benchmark result rows (JSON lines) into markdown tables, one per measured row of the
matrix. Ratios compare tokens/s with the baselines of the same run_id and the same shape
(workload, batch, sequence, budget) only: rows of different runs are never compared.

    python benchmarks/report.py benchmarks/results/*.jsonl [--run-id ID] [--workload W]
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

BASELINES = ("plain", "fsdp2_offload", "ds_z3_offload", "ds_z2_offload")
SYSTEM_ORDER = ("protrain", *BASELINES)
# Seconds a system reports per step beyond the row's standard fields (copy waits, CPU
# optimizer waits, ...): every other key ending in `_s` gets a column.
STANDARD_S = {"tokens_per_s", "step_s", "predicted_step_s", "time_to_first_step_s"}


def load(paths: list[Path]) -> list[dict]:
    rows = []
    for path in paths:
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as e:
                    raise SystemExit(f"{path}:{n}: not a JSON line ({e})") from e
    return rows


def append(path: Path, rows: list[dict]) -> None:
    """Append ``rows`` to a results file, one JSON line each (its folder made if missing)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")


def group_key(row: dict) -> tuple:
    return (row["run_id"], row["workload"], row["model"], row["mode"], row["budget_gib"],
            row["batch"], row["seq"], row["gpu"], row.get("max_grad_norm", "not recorded"))  # fmt: skip


def _num(value, digits: int) -> str:
    return "" if value is None else f"{value:,.{digits}f}"


def _plan(plan: dict | None) -> str:
    return "" if not plan else ", ".join(f"{k}={v}" for k, v in plan.items())


def ratios(row: dict, group: list[dict]) -> str:
    if row["system"] in BASELINES or row["status"] != "ok" or not row.get("tokens_per_s"):
        return ""
    out = []
    for base in group:
        if base["system"] in BASELINES:
            if base["status"] == "ok" and base.get("tokens_per_s"):
                out.append(f"{row['tokens_per_s'] / base['tokens_per_s']:.2f}x {base['system']}")
            else:
                out.append(f"{base['system']} {base['status']}")
    return ", ".join(out)


def table(group: list[dict]) -> str:
    extras = sorted({k for r in group for k in r if k.endswith("_s") and k not in STANDARD_S})
    header = ["system", "status", "tokens/s", "step s", "peak alloc GiB", "peak reserved GiB",
              "predicted peak GiB", "predicted step s", "plan", "first step s", *extras,
              "vs baselines"]  # fmt: skip
    lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    order = {s: i for i, s in enumerate(SYSTEM_ORDER)}
    for row in sorted(group, key=lambda r: order.get(r["system"], len(order))):
        cells = [
            row["system"],
            row["status"],
            _num(row.get("tokens_per_s"), 0),
            _num(row.get("step_s"), 3),
            _num(row.get("peak_alloc_gib"), 2),
            _num(row.get("peak_reserved_gib"), 2),
            _num(row.get("predicted_peak_gib"), 2),
            _num(row.get("predicted_step_s"), 3),
            _plan(row.get("plan")),
            _num(row.get("time_to_first_step_s"), 1),
            *(_num(row.get(k), 3) for k in extras),
            ratios(row, group),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def report(rows: list[dict]) -> str:
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for row in rows:
        groups[group_key(row)].append(row)
    parts = []
    for key, group in groups.items():
        run_id, workload, model, mode, budget, batch, seq, gpu, max_grad_norm = key
        budget_text = "no budget" if budget is None else f"{budget:g} GiB budget"
        clip_text = "no clipping" if max_grad_norm is None else f"clipping {max_grad_norm}"
        parts.append(
            f"### {workload}: {model} {mode}, batch {batch} x {seq}, {budget_text}, {clip_text}\n\n"
            f"run `{run_id}` on {gpu}, commit {group[0].get('commit', '?')}\n\n{table(group)}"
        )
        errors = [f"- {r['system']}: {r['error']}" for r in group if r.get("error")]
        if errors:
            parts[-1] += "\n\n" + "\n".join(errors)
    return "\n\n".join(parts) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("results", nargs="*", type=Path)
    p.add_argument("--run-id")
    p.add_argument("--workload")
    args = p.parse_args(argv)
    paths = args.results or sorted((Path(__file__).parent / "results").glob("*.jsonl"))
    rows = [
        r
        for r in load(paths)
        if (args.run_id is None or r["run_id"] == args.run_id)
        and (args.workload is None or r["workload"] == args.workload)
    ]
    sys.stdout.write(report(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
