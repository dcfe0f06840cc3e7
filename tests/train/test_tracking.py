"""Experiment tracking (`train/tracking.py`): the config keys, the one-line refusal of a tool
that is not installed, and for each tool, where it is installed, a short run whose offline
records (W&B's offline run folder, an MLflow `file:` store, TensorBoard's event files)
hold the numbers of metrics.jsonl, closed as the run ended."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

import protrain.train.loop as loop
from protrain.train.config import validate_config
from protrain.train.errors import ConfigError
from protrain.train.loop import train
from protrain.train.metrics import read_metrics

from .helpers import tiny_config

SHORT = dict(max_steps=3, sequence_len=32, micro_batch_size=2, gradient_accumulation_steps=1)
KEYS = ("loss", "lr", "grad_norm", "tokens_seen")


def _cfg(tmp_path: Path, **keys):
    return validate_config(tiny_config(tmp_path, **SHORT, **keys))


def _expected(run: Path) -> dict[int, dict[str, float]]:
    """metrics.jsonl's numbers of KEYS, by step."""
    return {
        r["step"]: {k: r[k] for k in KEYS if r.get(k) is not None}
        for r in read_metrics(run)
        if "loss" in r
    }


# -- the config keys ------------------------------------------------------------------


def test_the_trackers_a_config_names(tmp_path):
    assert _cfg(tmp_path).trackers == []
    assert _cfg(tmp_path, report_to="none").trackers == []
    assert _cfg(tmp_path, report_to="mlflow").trackers == ["mlflow"]
    both = _cfg(tmp_path, report_to=["tensorboard"], wandb_project="p", wandb_mode="offline")
    assert both.trackers == ["wandb", "tensorboard"]
    assert _cfg(tmp_path, mlflow_tracking_uri="file:///x", use_tensorboard=True).trackers == [
        "mlflow",
        "tensorboard",
    ]


@pytest.mark.parametrize(
    "keys,expect",
    [
        (dict(wandb_name="n"), "wandb_name is set but wandb is not one of the trackers"),
        (dict(mlflow_experiment_name="e"), "set mlflow_tracking_uri, or add mlflow to report_to"),
        (dict(report_to=["comet"]), "report_to.0 = 'comet' is not allowed"),
        (dict(report_to="all"), "name the trackers: a list of wandb, mlflow, tensorboard"),
        (dict(wandb_mode="cloud", wandb_project="p"), "wandb_mode = 'cloud' is not allowed"),
    ],
)
def test_a_bad_tracking_key_is_one_error(tmp_path, keys, expect):
    with pytest.raises(ConfigError) as err:
        _cfg(tmp_path, **keys)
    assert expect in str(err.value) and "\n" not in str(err.value)


def test_a_tool_not_installed_is_refused_before_any_work(tmp_path, monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "mlflow" else real(name, *a)
    )
    cfg = _cfg(tmp_path, report_to=["mlflow"])
    with pytest.raises(ConfigError) as err:
        train(cfg)
    assert "the mlflow package is not installed: pip install mlflow" in str(err.value)
    assert not (tmp_path / "run").exists(), "refused before anything was written"


# -- what the loop sends, with a recording tracker --------------------------------------


class _Recorder:
    def __init__(self):
        self.logged: dict[int, dict[str, float]] = {}
        self.closed: list[BaseException | None] = []

    def log(self, step, values):
        self.logged.setdefault(step, {}).update(values)

    def close(self, error):
        self.closed.append(error)


def test_the_loop_sends_metrics_and_closes_on_failure(tmp_path, monkeypatch):
    recorder = _Recorder()
    monkeypatch.setattr(loop, "open_trackers", lambda *a: [recorder])
    real_format = loop._format_log

    def fail_at_step_2(step, total, record):
        if step == 2:
            raise RuntimeError("failed on purpose")
        return real_format(step, total, record)

    monkeypatch.setattr(loop, "_format_log", fail_at_step_2)
    with pytest.raises(RuntimeError, match="failed on purpose"):
        train(_cfg(tmp_path))
    assert len(recorder.closed) == 1 and isinstance(recorder.closed[0], RuntimeError)
    sent = {s: {k: v[k] for k in KEYS if k in v} for s, v in recorder.logged.items()}
    assert sent == _expected(tmp_path / "run") and sorted(sent) == [1, 2]


# -- each tool in its own offline mode --------------------------------------------------


def test_tensorboard_event_files(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    train(_cfg(tmp_path, use_tensorboard=True))
    run = tmp_path / "run"
    events = EventAccumulator(str(run / "tensorboard"))
    events.Reload()
    got: dict[int, dict[str, float]] = {}
    for key in KEYS:
        for event in events.Scalars(key):
            got.setdefault(event.step, {})[key] = event.value
    want = _expected(run)
    assert sorted(got) == sorted(want) == [1, 2, 3]
    for step, values in want.items():
        assert got[step] == pytest.approx(values, rel=1e-6)  # stored as float32


def test_mlflow_local_store(tmp_path):
    """MLflow's own local store: an SQLite file (its `file:` store is the next test's)."""
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    train(_cfg(tmp_path, mlflow_tracking_uri=uri, mlflow_experiment_name="protrain-test"))
    client = MlflowClient(tracking_uri=uri)
    experiment = client.get_experiment_by_name("protrain-test")
    (run,) = client.search_runs([experiment.experiment_id])
    assert run.info.status == "FINISHED" and run.info.run_name == "run"
    assert run.data.params["learning_rate"] == "0.001" and run.data.params["model.name_or_path"]
    want = _expected(tmp_path / "run")
    for key in KEYS:
        history = {m.step: m.value for m in client.get_metric_history(run.info.run_id, key)}
        assert history == pytest.approx({s: v[key] for s, v in want.items()})


def test_mlflow_run_of_a_failed_training_is_failed(tmp_path, monkeypatch):
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient

    def fail(*args, **kwargs):
        raise RuntimeError("failed on purpose")

    monkeypatch.setattr(loop, "_format_log", fail)
    # MLflow 3.7+ writes a `file:` store only when asked to (it recommends SQLite)
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    uri = (tmp_path / "mlruns").as_uri()
    with pytest.raises(RuntimeError):
        train(_cfg(tmp_path, report_to=["mlflow"], mlflow_tracking_uri=uri))
    client = MlflowClient(tracking_uri=uri)
    (run,) = client.search_runs([client.get_experiment_by_name("Default").experiment_id])
    assert run.info.status == "FAILED"
    assert [m.step for m in client.get_metric_history(run.info.run_id, "loss")] == [1]


def test_a_tool_that_refuses_its_run_is_one_line(tmp_path, monkeypatch):
    pytest.importorskip("mlflow")
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    uri = (tmp_path / "mlruns").as_uri()
    with pytest.raises(ConfigError) as err:
        train(_cfg(tmp_path, mlflow_tracking_uri=uri))
    assert str(err.value).startswith("mlflow could not start its run: ")
    assert "\n" not in str(err.value)


def test_wandb_offline_run(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_SILENT", "true")
    cfg = _cfg(tmp_path, wandb_project="protrain-test", wandb_name="tiny", wandb_mode="offline")
    train(cfg)
    run = tmp_path / "run"
    (log,) = (run / "wandb").glob("offline-run-*/run-*.wandb")
    records = _wandb_records(log)
    (info,) = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    assert (info.project, info.display_name) == ("protrain-test", "tiny")
    got = {}
    for r in records:
        if r.WhichOneof("record_type") == "history":
            items = {i.key or ".".join(i.nested_key): i.value_json for i in r.history.item}
            got.setdefault(r.history.step.num, {}).update(
                {k: json.loads(items[k]) for k in KEYS if k in items}
            )
    assert got == _expected(run)
    (exit_record,) = [r.exit for r in records if r.WhichOneof("record_type") == "exit"]
    assert exit_record.exit_code == 0


def _wandb_records(path: Path) -> list:
    """The protobuf records of W&B's run log: a 7-byte header, then records framed as in
    LevelDB's log (4-byte checksum, 2-byte length, 1-byte type; 32 KiB blocks)."""
    from wandb.proto.wandb_internal_pb2 import Record

    data, pos, block, parts, records = path.read_bytes(), 7, 32768, [], []
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        length, kind = int.from_bytes(data[pos + 4 : pos + 6], "little"), data[pos + 6]
        parts.append(data[pos + 7 : pos + 7 + length])
        pos += 7 + length
        if kind in (1, 4):  # a whole record, or the last piece of one
            record = Record()
            record.ParseFromString(b"".join(parts))
            records.append(record)
            parts = []
    return records
