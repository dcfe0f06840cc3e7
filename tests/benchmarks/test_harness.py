"""The benchmark harness end to end on the CPU with a tiny model (no timing is checked)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCH))

import report  # noqa: E402

ROW_KEYS = [
    "workload", "system", "model", "mode", "budget_gib", "batch", "seq", "status",
    "tokens_per_s", "step_s", "peak_alloc_gib", "peak_reserved_gib", "predicted_peak_gib",
    "predicted_step_s", "plan", "gpu", "run_id", "commit", "time_to_first_step_s",
]  # fmt: skip


def _run(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(BENCH / "run.py"), "--tiny", "--steps", "1", "--warmup", "1",
         "--out", str(tmp_path / "rows.jsonl"), "--run-id", "test-run", *args],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip


@pytest.fixture(scope="module")
def plain_row(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, Path]:
    tmp_path = tmp_path_factory.mktemp("bench")
    proc = _run(tmp_path, "--workload", "fits", "--system", "plain")
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = (tmp_path / "rows.jsonl").read_text().splitlines()
    assert len(lines) == 1
    return json.loads(lines[0]), tmp_path


def test_plain_row_has_the_results_format(plain_row: tuple[dict, Path]) -> None:
    row, _ = plain_row
    assert list(row)[: len(ROW_KEYS)] == ROW_KEYS
    assert row["status"] == "ok"
    assert (row["workload"], row["system"], row["model"], row["mode"]) == (
        "fits", "plain", "tiny", "full",
    )  # fmt: skip
    assert row["run_id"] == "test-run"
    assert row["gpu"] == "cpu" and row["budget_gib"] is None
    assert row["tokens_per_s"] > 0 and row["step_s"] > 0 and row["time_to_first_step_s"] > 0
    assert row["tokens_per_s"] == pytest.approx(row["batch"] * row["seq"] / row["step_s"], 1e-2)


@pytest.mark.parametrize("system", ["plain", "protrain"])
def test_accumulation_rows_count_every_micro_batch(tmp_path: Path, system: str) -> None:
    """--grad-accum 3: one step is three micro-batches, each a backward, and the row's
    tokens are all of them; the loss is the last micro-batch's, a finite number."""
    proc = _run(tmp_path, "--workload", "fits", "--system", system, "--grad-accum", "3")
    assert proc.returncode == 0, proc.stderr[-2000:]
    row = json.loads((tmp_path / "rows.jsonl").read_text())
    assert row["status"] == "ok" and row["grad_accum"] == 3
    tokens = 3 * row["batch"] * row["seq"]
    assert row["tokens_per_s"] == pytest.approx(tokens / row["step_s"], 1e-2)


def test_missing_deepspeed_or_engine_is_an_error_row(tmp_path: Path) -> None:
    try:
        import deepspeed  # noqa: F401
    except ImportError:
        proc = _run(tmp_path, "--workload", "full-3b", "--system", "ds_z2_offload")
        row = json.loads((tmp_path / "rows.jsonl").read_text())
        assert proc.returncode == 1
        assert row["status"] == "error" and "DeepSpeed is not installed" in row["error"]
    else:
        pytest.skip("DeepSpeed is installed here")


def test_report_of_the_row(plain_row: tuple[dict, Path]) -> None:
    _, tmp_path = plain_row
    text = subprocess.run(
        [sys.executable, str(BENCH / "report.py"), str(tmp_path / "rows.jsonl")],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    assert "### fits: tiny full, batch 2 x 32, no budget, clipping 1.0" in text
    assert "| plain | ok |" in text


def _row(system: str, run_id: str, tokens_per_s: float | None, status: str = "ok") -> dict:
    return {
        "workload": "full-3b", "system": system, "model": "llama3b", "mode": "full",
        "budget_gib": 24, "batch": 4, "seq": 2048, "status": status,
        "tokens_per_s": tokens_per_s, "step_s": None if tokens_per_s is None else 8192 / tokens_per_s,
        "peak_alloc_gib": 14.0, "peak_reserved_gib": 15.0, "predicted_peak_gib": None,
        "predicted_step_s": None, "plan": None, "gpu": "NVIDIA H200", "run_id": run_id,
        "commit": "abc", "time_to_first_step_s": 10.0,
    }  # fmt: skip


def test_report_ratios_stay_within_a_run() -> None:
    rows = [
        _row("protrain", "A", 9000.0),
        _row("fsdp2_offload", "A", 4500.0),
        _row("plain", "A", None, status="oom"),
        _row("ds_z3_offload", "B", 1000.0),  # another run: never a ratio with run A
    ]
    text = report.report(rows)
    run_a = text.split("run `A`")[1].split("###")[0]
    protrain_line = next(line for line in run_a.splitlines() if line.startswith("| protrain"))
    assert "2.00x fsdp2_offload" in protrain_line
    assert "plain oom" in protrain_line
    assert "ds_z3_offload" not in protrain_line
    assert text.count("### full-3b") == 2


@pytest.mark.parametrize("clip,chunked", [("1.0", None), ("0", None), ("0", "16")])
def test_protrain_auto_row_carries_the_plan(tmp_path: Path, clip: str, chunked) -> None:
    extra = ["--chunked-loss-tokens", chunked] if chunked else []
    proc = _run(tmp_path, "--workload", "full-3b", "--system", "protrain", "--auto",
                "--max-grad-norm", clip, *extra)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    row = json.loads((tmp_path / "rows.jsonl").read_text().splitlines()[-1])
    assert row["status"] == "ok" and row["plan"]["auto"] is True
    assert set(row["plan"]) >= {"n_persist", "n_buffer", "n_swap", "n_checkpoint"}
    assert row["predicted_peak_gib"] > 0 and row["predicted_step_s"] > 0
    assert row["max_grad_norm"] == (None if clip == "0" else 1.0)
    assert row["chunked_loss_tokens"] == (int(chunked) if chunked else None)
    assert row["loss"] > 0


def test_protrain_auto_row_keeps_the_planners_profiles(tmp_path: Path) -> None:
    """``--profiles``: the row is planned as ``protrain.wrap(gpu_budget=)`` plans it (the same
    plan as without the flag) and the profiles it was planned from load back."""
    import gzip

    from protrain.profile.hardware import HardwareProfile
    from protrain.profile.trace import ModelProfile

    args = ("--workload", "full-3b", "--system", "protrain", "--auto", "--max-grad-norm", "0")
    assert _run(tmp_path, *args).returncode == 0
    proc = _run(tmp_path, *args, "--profiles", str(tmp_path / "prof"))
    assert proc.returncode == 0, proc.stderr[-2000:]
    plain, kept = (json.loads(x) for x in (tmp_path / "rows.jsonl").read_text().splitlines())
    for key in ("n_persist", "n_buffer", "n_swap", "n_checkpoint", "chunk_size_bytes"):
        assert kept["plan"][key] == plain["plan"][key], key
    assert kept["predicted_peak_gib"] == plain["predicted_peak_gib"]
    name = tmp_path / "prof" / "full-3b-b2-s32-w1"
    with gzip.open(f"{name}.profile.json.gz", "rt") as f:
        profile = ModelProfile.from_json(f.read())
    hw = HardwareProfile.from_dict(json.loads(Path(f"{name}.hardware.json").read_text()))
    assert profile.n_blocks > 0 and hw.cpu_adam_params_per_s > 0
    refused = _run(tmp_path, "--workload", "full-3b", "--system", "protrain", "--profiles", "x")
    assert refused.returncode != 0 and "--profiles writes the planner's profiles" in refused.stderr


def test_protrain_kernels_auto_row_records_the_kernels_that_ran(tmp_path: Path) -> None:
    """--kernels auto on the CPU: Liger's Triton kernels cannot run, so none do, and the
    row says so (the setting and the empty list the engine ran with)."""
    proc = _run(tmp_path, "--workload", "lora-8b", "--system", "protrain", "--kernels", "auto")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "kernels: none (model.kernels: auto; no CUDA GPU (cpu)" in proc.stdout
    row = json.loads((tmp_path / "rows.jsonl").read_text())
    assert row["status"] == "ok" and row["mode"] == "lora"
    assert row["kernels_setting"] == "auto" and row["plan"]["kernels"] == []


def test_protrain_row_runs_the_optimizer_state_it_names(tmp_path: Path) -> None:
    """--optimizer-state bf16 reaches the engine: the row's plan says which format the
    engine's optimizer keeps (read back from it), beside the row's request."""
    proc = _run(tmp_path, "--workload", "fits", "--system", "protrain", "--n-persist", "0",
                "--n-buffer", "2", "--optimizer-state", "bf16")  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    row = json.loads((tmp_path / "rows.jsonl").read_text())
    assert row["status"] == "ok", row.get("error")
    assert row["optimizer_state"] == "bf16" and row["plan"]["optimizer_state"] == "bf16"


def test_packed_row_feeds_the_samples_of_one_pack(tmp_path: Path) -> None:
    """--pack-samples K: one row of seq tokens holding K samples (position_ids restart at
    each), so the model attends within each; one sample is the plain causal row. The CPU
    runs sdpa only: flex_attention is refused there with the reason."""
    rows = {}
    for k in (1, 4):
        out = tmp_path / f"k{k}"
        out.mkdir()
        proc = _run(out, "--workload", "lora-8b", "--system", "plain", "--pack-samples", str(k))
        assert proc.returncode == 0, proc.stderr[-2000:]
        rows[k] = json.loads((out / "rows.jsonl").read_text())
    for k, row in rows.items():
        assert row["status"] == "ok" and (row["attn"], row["pack_samples"]) == ("sdpa", k)
        assert row["batch"] == 1
        assert row["tokens_per_s"] == pytest.approx(row["seq"] / row["step_s"], 1e-2)
    assert rows[1]["loss"] != rows[4]["loss"]  # the same tokens, cut into four samples
    refused = _run(tmp_path, "--workload", "lora-8b", "--system", "plain",
                   "--attn", "flex_attention", "--pack-samples", "4")  # fmt: skip
    assert refused.returncode != 0
    assert "flex_attention needs a CUDA GPU: torch has no flex_attention backward" in (
        refused.stderr
    )
