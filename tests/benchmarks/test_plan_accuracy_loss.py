"""plan_accuracy.py's loss: by default the planner owns the loss chunk, as the application's
default user gets it; `--chunked-loss-tokens N` is a user who fixed it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCH))

import plan_accuracy  # noqa: E402


def _row(*flags: str) -> dict:
    args = plan_accuracy.parse_args(["--tiny", "--steps", "1", "--warmup", "1", *flags])
    return plan_accuracy.run_one("tiny-lora", plan_accuracy.TINY["tiny-lora"], args)


def test_the_default_row_plans_the_loss_chunk_and_steps_run_the_plans():
    row = _row()
    assert row["status"] == "ok", row.get("error")
    assert row["loss_chunk"] == "planned"  # the plan's loss_planned
    # traced at the smallest chunk; the search chose among off, 64 and 32 (2 x 64 positions)
    assert row["loss_chunk_traced"] == plan_accuracy.TINY_LOSS_CHUNK_FLOOR_TOKENS
    assert row["search_work"]["loss_chunks"] >= 2  # the smallest, then off (and maybe 64)
    assert row["chunked_loss_tokens"] in (None, 64, 32)


def test_a_fixed_chunk_row_says_so():
    row = _row("--chunked-loss-tokens", "64")
    assert row["status"] == "ok", row.get("error")
    # traced and stepped at the user's chunk
    assert (row["loss_chunk"], row["chunked_loss_tokens"], row["loss_chunk_traced"]) == (
        "fixed",
        64,
        64,
    )


def test_the_child_gets_the_loss_chunk_only_where_the_user_fixed_it(tmp_path, monkeypatch):
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)  # main sets it; restored after
    commands = []

    def fake_run(cmd, **kw):
        commands.append(cmd)
        row = {"config": cmd[cmd.index("--child") + 1], "status": "error", "error": "not run"}
        return subprocess.CompletedProcess(cmd, 0, stdout=json.dumps(row) + "\n", stderr="")

    monkeypatch.setattr(plan_accuracy.subprocess, "run", fake_run)
    out = str(tmp_path / "rows.jsonl")
    assert plan_accuracy.main(["--tiny", "--only", "tiny-lora", "--out", out]) == 0
    assert plan_accuracy.main(["--tiny", "--only", "tiny-lora", "--out", out,
                               "--chunked-loss-tokens", "4096"]) == 0  # fmt: skip
    planned, fixed = commands
    assert "--chunked-loss-tokens" not in planned
    assert fixed[fixed.index("--chunked-loss-tokens") + 1] == "4096"
