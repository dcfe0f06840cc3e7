"""Experiment tracking: the records of `metrics.jsonl` also sent to Weights & Biases, MLflow
and TensorBoard, each where the config asks for it, with axolotl's keys:

    report_to: [wandb, mlflow, tensorboard]   # as the HF Trainer's; or any of:
    wandb_project: my-project                 # W&B (with wandb_entity, wandb_name, wandb_mode)
    mlflow_tracking_uri: file:///data/mlruns  # MLflow (with mlflow_experiment_name)
    use_tensorboard: true                     # TensorBoard event files in output_dir/tensorboard

A tool is imported only when configured; one that is not installed is refused before any
work, in one line naming its pip package. Rank 0 alone sends (it alone has a metrics
writer, `loop.py`), each record as it writes it to metrics.jsonl: the numbers of the record
at its optimizer step (a null, such as a skipped step's gradient norm, is left out). The
runs are closed when training ends, marked failed (MLflow: FAILED, W&B: exit code 1) when it
raised, stopped (KILLED, exit code 130 or 143) when a signal stopped it. A resumed run is a
new run of each tool that starts at the checkpoint's step.
"""

from __future__ import annotations

import importlib.util
import json
import time
from pathlib import Path
from typing import Any, Literal, Protocol

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from protrain.train.errors import ConfigError

TRACKERS = ("wandb", "mlflow", "tensorboard")
# the module each tool is imported as -> the pip package that provides it
PIP_PACKAGES = {"wandb": "wandb", "mlflow": "mlflow", "tensorboard": "tensorboard"}


class TrackingSettings(BaseModel):
    """Top-level tracking keys of the YAML config (axolotl's names)."""

    model_config = ConfigDict(extra="forbid")

    report_to: list[Literal["wandb", "mlflow", "tensorboard"]] = Field(
        default_factory=list,
        description="Trackers the metrics also go to (as the HF Trainer's report_to); "
        "wandb_project, mlflow_tracking_uri and use_tensorboard each add theirs.",
    )
    wandb_project: str | None = None
    wandb_entity: str | None = None
    wandb_name: str | None = Field(None, description="The W&B run's name.")
    wandb_mode: Literal["online", "offline", "disabled"] | None = Field(
        None, description="Unset: wandb's own (WANDB_MODE, else online)."
    )
    mlflow_tracking_uri: str | None = Field(
        None, description="e.g. http://host:5000 or file:///path/mlruns; unset: MLflow's own."
    )
    mlflow_experiment_name: str | None = None
    use_tensorboard: bool = False

    @field_validator("report_to", mode="before")
    @classmethod
    def _one_or_more(cls, value: Any) -> Any:
        if value is None or value == "none":
            return []
        if value == "all":
            raise ValueError("name the trackers: a list of wandb, mlflow, tensorboard")
        return [value] if isinstance(value, str) else value

    @model_validator(mode="after")
    def _check_tracker_keys(self) -> TrackingSettings:
        trackers = self.trackers
        unused = [
            (key, tool, enabling)
            for key, tool, enabling in (
                ("wandb_entity", "wandb", "wandb_project"),
                ("wandb_name", "wandb", "wandb_project"),
                ("wandb_mode", "wandb", "wandb_project"),
                ("mlflow_experiment_name", "mlflow", "mlflow_tracking_uri"),
            )
            if getattr(self, key) is not None and tool not in trackers
        ]
        if unused:
            key, tool, enabling = unused[0]
            raise ValueError(
                f"{key} is set but {tool} is not one of the trackers: set {enabling}, or add "
                f"{tool} to report_to (or remove {key})"
            )
        return self

    @property
    def trackers(self) -> list[str]:
        """The trackers this config sends to, in TRACKERS' order."""
        asked = set(self.report_to)
        asked |= {"wandb"} if self.wandb_project else set()
        asked |= {"mlflow"} if self.mlflow_tracking_uri else set()
        asked |= {"tensorboard"} if self.use_tensorboard else set()
        return [name for name in TRACKERS if name in asked]


class Tracker(Protocol):
    def log(self, step: int, values: dict[str, float]) -> None: ...

    def close(self, error: BaseException | None) -> None: ...


def check_trackers_installed(settings: TrackingSettings) -> None:
    """A ConfigError naming the pip package of the first configured tool not installed."""
    for name in settings.trackers:
        if importlib.util.find_spec(name) is None:
            raise ConfigError(
                f"experiment tracking with {name} is configured, but the {name} package is "
                f"not installed: pip install {PIP_PACKAGES[name]} (or protrain[tracking]), or "
                f"remove it from the config"
            )


def open_trackers(settings: TrackingSettings, output_dir: Path, config: dict) -> list[Tracker]:
    """A started run of each configured tool; ``config`` (the resolved config) is recorded
    with it."""
    opened: list[Tracker] = []
    for name in settings.trackers:
        try:
            opened.append(_OPENERS[name](settings, output_dir, config))
        except Exception as exc:  # a tool's refusal (a bad URI, a store it no longer writes)
            for tracker in opened:
                tracker.close(exc)
            text = " ".join(str(exc).split()) or type(exc).__name__
            raise ConfigError(f"{name} could not start its run: {text}") from exc
    return opened


def numbers(values: dict[str, Any]) -> dict[str, float]:
    """The entries of a metrics record that trackers take: numbers (not None, not bools)."""
    return {
        k: v for k, v in values.items() if isinstance(v, int | float) and not isinstance(v, bool)
    }


def _exit_code(error: BaseException | None) -> int:
    """0 finished, a stop signal's status (130, 143: `TrainingStopped`), else 1."""
    if error is None:
        return 0
    code = getattr(error, "code", None) if isinstance(error, SystemExit) else None
    return code if isinstance(code, int) and code > 128 else 1


class _WandbTracker:
    def __init__(self, settings: TrackingSettings, output_dir: Path, config: dict):
        # optional dependency (wandb, the tracking extra)
        import wandb

        self._run = wandb.init(
            project=settings.wandb_project,
            entity=settings.wandb_entity,
            name=settings.wandb_name,
            mode=settings.wandb_mode,
            dir=str(output_dir),  # W&B writes its run folder in output_dir/wandb
            config=config,
        )

    def log(self, step: int, values: dict[str, float]) -> None:
        self._run.log(values, step=step)

    def close(self, error: BaseException | None) -> None:
        self._run.finish(exit_code=_exit_code(error))


class _MlflowTracker:
    def __init__(self, settings: TrackingSettings, output_dir: Path, config: dict):
        # optional dependency (mlflow, the tracking extra)
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        # a client of its own: no process-wide active run or tracking URI is set
        self._client = MlflowClient(tracking_uri=settings.mlflow_tracking_uri)
        name = settings.mlflow_experiment_name or "Default"
        experiment = self._client.get_experiment_by_name(name)
        experiment_id = (
            experiment.experiment_id if experiment else self._client.create_experiment(name)
        )
        run = self._client.create_run(experiment_id, run_name=output_dir.name)
        self._run_id = run.info.run_id
        # the config as the run's parameters (no artifact: nothing written beside the store)
        params = [Param(key, value) for key, value in _flat_params(config).items()]
        self._client.log_batch(self._run_id, params=params)

    def log(self, step: int, values: dict[str, float]) -> None:
        # optional dependency (mlflow, the tracking extra)
        from mlflow.entities import Metric

        now_ms = int(time.time() * 1000)
        metrics = [Metric(key, float(value), now_ms, step) for key, value in values.items()]
        self._client.log_batch(self._run_id, metrics=metrics)

    def close(self, error: BaseException | None) -> None:
        code = _exit_code(error)
        status = "FINISHED" if code == 0 else "KILLED" if code > 128 else "FAILED"
        self._client.set_terminated(self._run_id, status=status)


MLFLOW_PARAM_CHARS = 6000  # the longest parameter value MLflow's stores take


def _flat_params(config: dict, prefix: str = "") -> dict[str, str]:
    """``config`` as MLflow parameters: nested keys dotted, lists as JSON."""
    flat: dict[str, str] = {}
    for key, value in config.items():
        if isinstance(value, dict):
            flat.update(_flat_params(value, f"{prefix}{key}."))
        else:
            text = json.dumps(value) if isinstance(value, list) else str(value)
            flat[f"{prefix}{key}"] = text[:MLFLOW_PARAM_CHARS]
    return flat


class _TensorBoardTracker:
    def __init__(self, settings: TrackingSettings, output_dir: Path, config: dict):
        from torch.utils.tensorboard import SummaryWriter  # needs the tensorboard package

        self._writer = SummaryWriter(log_dir=str(output_dir / "tensorboard"))

    def log(self, step: int, values: dict[str, float]) -> None:
        for key, value in values.items():
            self._writer.add_scalar(key, value, step)

    def close(self, error: BaseException | None) -> None:
        self._writer.close()


_OPENERS = {"wandb": _WandbTracker, "mlflow": _MlflowTracker, "tensorboard": _TensorBoardTracker}
