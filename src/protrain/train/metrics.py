"""Training metrics: JSON lines in `output_dir/metrics.jsonl`, and TensorBoard when installed."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from protrain.train.log import logger


class MetricsWriter:
    def __init__(self, output_dir: Path):
        self.path = output_dir / "metrics.jsonl"
        self._file = open(self.path, "a")  # noqa: SIM115 (closed by close())
        self._tensorboard = None
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            logger.info("tensorboard is not installed; metrics go to metrics.jsonl only")
        else:
            self._tensorboard = SummaryWriter(log_dir=str(output_dir / "tensorboard"))

    def write(self, step: int, values: dict[str, Any]) -> None:
        record = {"step": step, **values}
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        if self._tensorboard is not None:
            for key, value in values.items():
                if isinstance(value, int | float):
                    self._tensorboard.add_scalar(key, value, step)

    def close(self) -> None:
        self._file.close()
        if self._tensorboard is not None:
            self._tensorboard.close()


def read_metrics(output_dir: Path) -> list[dict[str, Any]]:
    path = Path(output_dir) / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def set_aside_metrics(output_dir: Path, after_step: int | None = None) -> int:
    """Move records that a new run supersedes out of `metrics.jsonl`; return how many.

    With `after_step` (a resume), the records of later steps go to
    `metrics.superseded.jsonl`; without it (a fresh run in a directory whose earlier run
    left no checkpoint), the whole file becomes `metrics.stale-<n>.jsonl`. Nothing is
    deleted.
    """
    path = Path(output_dir) / "metrics.jsonl"
    if not path.exists():
        return 0
    lines = [line for line in path.read_text().splitlines() if line.strip()]
    if after_step is None:
        n = 1
        while (stale := path.with_name(f"metrics.stale-{n}.jsonl")).exists():
            n += 1
        path.rename(stale)
        return len(lines)
    keep = [line for line in lines if json.loads(line)["step"] <= after_step]
    later = [line for line in lines if json.loads(line)["step"] > after_step]
    if later:
        with open(path.with_name("metrics.superseded.jsonl"), "a") as f:
            f.write("\n".join(later) + "\n")
        tmp = path.with_name("metrics.jsonl.tmp")
        tmp.write_text("".join(line + "\n" for line in keep))
        tmp.replace(path)
    return len(later)
