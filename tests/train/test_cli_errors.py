"""Bad input: one clear line on stderr, non-zero exit, no traceback, nothing written."""

import json
import os
import shutil
import subprocess
import sys

import pytest

from protrain.train.config import QUICKSTART_DIR

from .helpers import tiny_config, write_config


def run_cli(*args: str, cwd=None, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "protrain", *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        env={**os.environ, "PROTRAIN_DEBUG": "", **(env or {})},
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


@pytest.mark.parametrize("n", ["0", "-2"])
def test_inspect_data_wants_at_least_one_sample(n):
    proc = run_cli("inspect-data", "-n", n)
    assert proc.returncode == 2
    assert proc.stderr.strip().endswith(
        f"argument -n/--num-samples: {n} is not allowed: at least 1"
    )


def test_version():
    proc = run_cli("--version")
    assert proc.returncode == 0 and proc.stdout.startswith("protrain ")


def test_model_path_that_does_not_exist(tmp_path):
    raw = tiny_config(tmp_path, model={"name_or_path": str(tmp_path / "no-model")})
    proc = run_cli("train", str(write_config(tmp_path, raw)))
    assert_one_line_error(proc, "model.name_or_path", "no such file or directory")
    assert not (tmp_path / "run").exists()


# --------------------------------------------------------------------------------------
# File and OS errors: the exact line, exit status 2, no traceback


def the_error(proc: subprocess.CompletedProcess) -> str:
    """The one `error:` line of a run that failed as the user's mistake."""
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, proc.stderr
    return errors[0]


def test_config_that_is_not_utf8(tmp_path):
    path = tmp_path / "latin1.yaml"
    path.write_bytes(b"model: {name_or_path: tiny}\n# caf\xe9\n")
    assert the_error(run_cli("train", str(path))) == (
        f"error: config file {str(path)!r} is not UTF-8 text at line 2, column 6: "
        "byte 0xe9 (invalid continuation byte)"
    )


def test_config_that_is_a_directory(tmp_path):
    path = tmp_path / "config.yaml"
    path.mkdir()
    assert the_error(run_cli("plan", str(path))) == (
        f"error: config file {str(path)!r} is a directory, not a file"
    )


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads files whatever their mode")
def test_config_that_cannot_be_read(tmp_path):
    path = write_config(tmp_path, tiny_config(tmp_path))
    path.chmod(0)
    assert the_error(run_cli("train", str(path))) == (
        f"error: config file {str(path)!r}: cannot read it (Permission denied)"
    )


def test_empty_datasets_list(tmp_path):
    path = write_config(tmp_path, tiny_config(tmp_path, datasets=[]))
    assert the_error(run_cli("train", str(path))) == (
        f"error: {path}: datasets = [] is not allowed: training needs at least one dataset, "
        "e.g. datasets: [{path: data.jsonl, type: chat}]"
    )


def test_jsonl_with_bytes_that_are_not_utf8(tmp_path):
    data = tmp_path / "chat.jsonl"
    good = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}
    data.write_bytes(
        (json.dumps(good) + "\n").encode()
        + b'{"messages": [{"role": "user", "content": "caf\xe9"}]}\n'
    )
    raw = tiny_config(tmp_path, datasets=[{"path": str(data), "type": "chat"}])
    assert the_error(run_cli("train", str(write_config(tmp_path, raw)))) == (
        f"error: dataset {str(data)!r}: {data} is not UTF-8 text at line 2, column 47: "
        "byte 0xe9 (invalid continuation byte); save it as UTF-8"
    )
    assert not (tmp_path / "run").exists()


def test_model_directory_with_only_config_json(tmp_path):
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    shutil.copy(QUICKSTART_DIR / "model.json", model_dir / "config.json")
    raw = tiny_config(tmp_path, model={"name_or_path": str(model_dir)})
    assert the_error(run_cli("train", str(write_config(tmp_path, raw)))) == (
        f"error: model.name_or_path = {str(model_dir)!r}: the directory holds no tokenizer "
        "files (tokenizer.json, tokenizer_config.json, tokenizer.model, vocab.json, vocab.txt, "
        "spiece.model): set model.tokenizer to the tokenizer's hub id or directory"
    )
    assert not (tmp_path / "run").exists()


def test_model_that_needs_trust_remote_code(tmp_path):
    model_dir = tmp_path / "model"
    shutil.copytree(QUICKSTART_DIR / "tokenizer", model_dir)
    (model_dir / "config.json").write_text(
        json.dumps(
            {
                "model_type": "mymodel",
                "auto_map": {
                    "AutoConfig": "configuration_mine.MyConfig",
                    "AutoModelForCausalLM": "modeling_mine.MyModel",
                },
            }
        )
    )
    raw = tiny_config(tmp_path, model={"name_or_path": str(model_dir)})
    assert the_error(run_cli("train", str(write_config(tmp_path, raw)))) == (
        f"error: model.name_or_path = {str(model_dir)!r} needs its own Python code to load "
        "(transformers does not know its model type): set model.trust_remote_code: true if "
        "you trust that code"
    )
    assert not (tmp_path / "run").exists()


def test_preprocess_without_a_folder_to_write_to():
    assert the_error(run_cli("preprocess")) == (
        "error: dataset_prepared_path is not set: preprocess needs a folder to write to, "
        "e.g. --set dataset_prepared_path=prepared"
    )


def test_os_error_names_its_path(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    proc = run_cli("preprocess", "--set", f"dataset_prepared_path={blocker}")
    line = the_error(proc)
    assert line.startswith(f"error: '{blocker}/") and line.endswith("': Not a directory"), line


def test_debug_shows_the_traceback(tmp_path):
    path = tmp_path / "config.yaml"
    path.mkdir()
    for proc in (
        run_cli("--debug", "train", str(path)),
        run_cli("train", str(path), "--debug"),
        run_cli("train", str(path), env={"PROTRAIN_DEBUG": "1"}),
    ):
        assert proc.returncode != 0
        assert "Traceback" in proc.stderr
        assert "ConfigError: config file" in proc.stderr


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    """A run of 2 steps with a checkpoint at step 2."""
    root = tmp_path_factory.mktemp("finished")
    raw = tiny_config(root, max_steps=2, save_steps=2)
    proc = run_cli("train", str(write_config(root, raw)))
    assert proc.returncode == 0, proc.stderr
    return root


def resumable_copy(finished_run, tmp_path):
    """The finished run as a copy to resume in `tmp_path` (its `final` removed), and its
    config with one more step."""
    shutil.copytree(finished_run / "run", tmp_path / "run")
    shutil.rmtree(tmp_path / "run" / "final")
    return write_config(tmp_path, tiny_config(tmp_path, max_steps=3, save_steps=2))


def test_resume_sets_aside_a_cut_metrics_line(finished_run, tmp_path):
    path = resumable_copy(finished_run, tmp_path)
    metrics = tmp_path / "run" / "metrics.jsonl"
    with open(metrics, "a") as f:
        f.write('{"step": 3, "lo')
    proc = run_cli("train", str(path), "--resume")
    assert proc.returncode == 0, proc.stderr
    assert f"the last line of {metrics} was cut short by an unfinished write" in proc.stderr
    superseded = (tmp_path / "run" / "metrics.superseded.jsonl").read_text()
    assert superseded.endswith('{"step": 3, "lo\n')
    steps = [json.loads(line)["step"] for line in metrics.read_text().splitlines()]
    assert steps[-1] == 3


def test_resume_with_a_bad_metrics_line(finished_run, tmp_path):
    path = resumable_copy(finished_run, tmp_path)
    metrics = tmp_path / "run" / "metrics.jsonl"
    lines = metrics.read_text().splitlines()
    metrics.write_text("\n".join([lines[0], "garbage", *lines[1:]]) + "\n")
    assert the_error(run_cli("train", str(path), "--resume")) == (
        f"error: line 2 of {metrics} is not a metrics record ('garbage'): delete that line, "
        "or move the file aside, and run again"
    )


@pytest.mark.parametrize(
    "garbage, problem",
    [
        (
            b"\x00\x01\xff\xfe",
            " is not UTF-8 text at line 1, column 3: byte 0xff (invalid start byte)",
        ),
        (b"- just\n- a list\n", ": the top level must be a mapping of keys, got list"),
    ],
)
def test_resume_with_a_garbage_recorded_config(finished_run, tmp_path, garbage, problem):
    path = resumable_copy(finished_run, tmp_path)
    recorded = tmp_path / "run" / "config.yaml"
    recorded.write_bytes(garbage)
    assert the_error(run_cli("train", str(path), "--resume")) == (
        f"error: --resume: the run's recorded config {str(recorded)!r}{problem}; restore it, "
        "or delete it to record this run's config instead"
    )


def test_a_run_names_its_recorded_config_and_leaves_out_transformers_long_row_line(tmp_path):
    """The resolved config goes to output_dir/config.yaml, the console says where in one
    line; a row longer than the tokenizer's model_max_length (2048) is reported by
    ProTrain's truncation line alone, not by transformers' "indexing errors" line too."""
    data = tmp_path / "chat.jsonl"
    short = {
        "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    }
    long = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "so " * 3000}]}  # fmt: skip
    data.write_text("\n".join(json.dumps(r) for r in [long] + [short] * 7) + "\n")
    raw = tiny_config(tmp_path, datasets=[{"path": str(data), "type": "chat"}], max_steps=1)
    raw.update(micro_batch_size=2, gradient_accumulation_steps=1)
    proc = run_cli("train", str(write_config(tmp_path, raw)))
    assert proc.returncode == 0, proc.stderr
    recorded = tmp_path / "run" / "config.yaml"
    assert f"resolved config (every key) written to {recorded}" in proc.stderr
    assert "learning_rate:" not in proc.stderr and "learning_rate:" in recorded.read_text()
    assert "1 sample(s) longer than sequence_len were truncated" in proc.stderr
    assert "indexing errors" not in proc.stderr, proc.stderr


@pytest.mark.parametrize("offline", [False, True], ids=["hub-unreachable", "HF_HUB_OFFLINE"])
def test_a_hub_name_that_cannot_be_had_is_one_line_at_once(tmp_path, offline):
    """A typo'd hub id on a machine without the hub: one line before any retry (the hub's
    client retried for about a minute against a refused connection)."""
    import time

    name = "Qwen/Qwen2.5-0.5B-Instrcut"
    raw = tiny_config(tmp_path, model={"name_or_path": name})
    env = {"HF_HOME": str(tmp_path / "hf"), "HF_ENDPOINT": "http://127.0.0.1:9"}
    env.update({v: "" for v in ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy")})
    if offline:
        env["HF_HUB_OFFLINE"] = "1"
    start = time.monotonic()
    line = the_error(run_cli("train", str(write_config(tmp_path, raw)), env=env))
    took_s = time.monotonic() - start
    why = "HF_HUB_OFFLINE is set" if offline else "Connection refused"
    assert line == (
        f"error: model.name_or_path = {name!r} is not a local directory nor in the Hugging Face "
        f"cache, and the hub (http://127.0.0.1:9) cannot be reached: {why}; check the name "
        "(a typo?), or give a local directory"
    )
    assert took_s < 50, took_s  # the imports, not a minute of retries
    assert not (tmp_path / "run").exists()


def test_an_endpoint_with_a_bad_port_is_a_reason_not_a_traceback():
    from protrain.train.hub_source import _unreachable

    assert "is no address" in _unreachable("https://huggingface.co:99999")
