"""Bad input: one clear line on stderr, non-zero exit, no traceback, nothing written."""

import json
import subprocess
import sys

import pytest

from .helpers import tiny_config, write_config


def run_cli(*args: str, cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "protrain", *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        timeout=300,
    )


def assert_one_line_error(proc: subprocess.CompletedProcess, *needles: str) -> None:
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, proc.stderr
    for needle in needles:
        assert needle in errors[0], errors[0]


def bad_data_file(tmp_path):
    path = tmp_path / "bad.jsonl"
    rows = [
        {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]},
        {"prompt": "no messages here"},
    ]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


@pytest.mark.parametrize(
    "case",
    ["misspelled_key", "negative_lr", "missing_dataset", "row_without_fields", "engine_knob"],
)
def test_bad_config_fails_cleanly(tmp_path, case):
    raw = tiny_config(tmp_path)
    needles: tuple[str, ...]
    if case == "misspelled_key":
        raw["micro_batch_sise"] = 2
        needles = ("micro_batch_sise", "micro_batch_size")
    elif case == "negative_lr":
        raw["learning_rate"] = -1.0
        needles = ("learning_rate", "-1.0", "greater than 0")
    elif case == "missing_dataset":
        raw["datasets"] = [{"path": str(tmp_path / "nope.jsonl"), "type": "chat"}]
        needles = ("nope.jsonl",)
    elif case == "row_without_fields":
        raw["datasets"] = [{"path": str(bad_data_file(tmp_path)), "type": "chat"}]
        needles = ("bad.jsonl", "row 1")
    else:
        raw["memory"] = {"n_persist": 1000, "n_buffer": 2}
        needles = ("memory", "n_persist=1000")
    path = write_config(tmp_path, raw)
    proc = run_cli("train", str(path))
    assert_one_line_error(proc, *needles)
    assert not (tmp_path / "run").exists()


def test_refuses_to_overwrite_a_finished_run(tmp_path):
    (tmp_path / "run" / "checkpoint-5").mkdir(parents=True)
    path = write_config(tmp_path, tiny_config(tmp_path))
    proc = run_cli("train", str(path))
    assert_one_line_error(proc, "already holds a training run", "--resume")
    assert (tmp_path / "run" / "checkpoint-5").is_dir()


def test_resume_without_checkpoint(tmp_path):
    path = write_config(tmp_path, tiny_config(tmp_path))
    proc = run_cli("train", str(path), "--resume")
    assert_one_line_error(proc, "no checkpoint")


def test_inspect_data_marks_trained_spans():
    proc = run_cli("inspect-data", "-n", "1")
    assert proc.returncode == 0, proc.stderr
    assert "<|im_start|>assistant\n[[" in proc.stdout
    assert "<|im_end|>]]" in proc.stdout


def test_version():
    proc = run_cli("--version")
    assert proc.returncode == 0 and proc.stdout.startswith("protrain ")


def test_model_path_that_does_not_exist(tmp_path):
    raw = tiny_config(tmp_path, model={"name_or_path": str(tmp_path / "no-model")})
    proc = run_cli("train", str(write_config(tmp_path, raw)))
    assert_one_line_error(proc, "model.name_or_path", "no such file or directory")
    assert not (tmp_path / "run").exists()
