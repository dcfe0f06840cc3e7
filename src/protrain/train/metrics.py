"""Training metrics: JSON lines in `output_dir/metrics.jsonl`, and the experiment trackers
the config names (W&B, MLflow, TensorBoard: `train/tracking.py`)."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from protrain.train.errors import OutputDirError
from protrain.train.log import logger
from protrain.train.tracking import Tracker, numbers


class MetricsWriter:
    """`metrics.jsonl`, and each record's numbers to the experiment trackers the config
    asked for (`train/tracking.py`)."""

    def __init__(self, output_dir: Path, trackers: Sequence[Tracker] = ()):
        self.path = output_dir / "metrics.jsonl"
        self._file = open(self.path, "a")  # noqa: SIM115 (closed by close())
        self._trackers = list(trackers)

    def write(self, step: int, values: dict[str, Any]) -> None:
        # strict JSON: a NaN or inf (a skipped step's gradient norm) is written null
        values = {k: None if _non_finite(v) else v for k, v in values.items()}
        record = {"step": step, **values}
        self._file.write(json.dumps(record, allow_nan=False) + "\n")
        self._file.flush()
        for tracker in self._trackers:
            tracker.log(step, numbers(values))

    def close(self, error: BaseException | None = None) -> None:
        """``error``: what ended the run, where it raised (the trackers mark it failed)."""
        self._file.close()
        for tracker in self._trackers:
            try:
                tracker.close(error)
            except Exception as exc:  # the run's result (and its own error) comes first
                logger.warning("closing the %s run failed: %s", type(tracker).__name__, exc)


def _non_finite(value: Any) -> bool:
    return isinstance(value, float) and not math.isfinite(value)


def read_metrics(output_dir: Path) -> list[dict[str, Any]]:
    path = Path(output_dir) / "metrics.jsonl"
    if not path.exists():
        return []
    return [record for _, record in _records(path)[0]]


def _records(path: Path) -> tuple[list[tuple[str, dict[str, Any]]], str | None]:
    """`(line, record)` pairs of a metrics file, and its last line apart when a write that
    did not finish (a kill, a full disk) cut it short. A bad line elsewhere is an
    OutputDirError naming the file and the line."""
    data = path.read_bytes()
    lines = data.decode("utf-8", errors="replace").splitlines()
    numbered = [(n, line) for n, line in enumerate(lines, 1) if line.strip()]
    records, cut = [], None
    for i, (n, line) in enumerate(numbered):
        try:
            record = json.loads(line)
            if not isinstance(record, dict) or "step" not in record:
                raise ValueError("not a metrics record")
        except ValueError:
            if i == len(numbered) - 1 and not data.endswith(b"\n"):  # every write ends one
                cut = line
                break
            raise OutputDirError(
                f"line {n} of {path} is not a metrics record ({line[:40]!r}): delete that "
                "line, or move the file aside, and run again"
            ) from None
        records.append((line, record))
    return records, cut


def set_aside_metrics(output_dir: Path, after_step: int | None = None) -> int:
    """Move records that a new run supersedes out of `metrics.jsonl`; return how many.

    With `after_step` (a resume), the records of later steps, and a last line cut short by
    an unfinished write, go to `metrics.superseded.jsonl`; without it (a fresh run in a
    directory whose earlier run left no checkpoint), the whole file becomes
    `metrics.stale-<n>.jsonl`. Nothing is deleted.
    """
    path = Path(output_dir) / "metrics.jsonl"
    if not path.exists():
        return 0
    if after_step is None:
        n_lines = sum(1 for line in path.read_bytes().splitlines() if line.strip())
        n = 1
        while (stale := path.with_name(f"metrics.stale-{n}.jsonl")).exists():
            n += 1
        path.rename(stale)
        return n_lines
    records, cut = _records(path)
    keep = [line for line, record in records if record["step"] <= after_step]
    later = [line for line, record in records if record["step"] > after_step]
    if cut is not None:
        logger.warning("the last line of %s was cut short by an unfinished write: set aside", path)
        later.append(cut)
    if later:
        with open(path.with_name("metrics.superseded.jsonl"), "a") as f:
            f.write("\n".join(later) + "\n")
        tmp = path.with_name("metrics.jsonl.tmp")
        tmp.write_text("".join(line + "\n" for line in keep))
        tmp.replace(path)
    return len(later)
