"""Reading dataset rows: local JSONL, JSON, Parquet and CSV files and folders, or the hub.

Rows come back as plain dicts in file order; `select_rows` then applies `shuffle` (seeded)
and `max_samples`. JSON and JSONL are parsed here, line by line, so that a broken line is
reported with its row index; Parquet, CSV and hub datasets go through `datasets`. A line
that is not JSON, or not a JSON object, is an `UnreadableRow` in its place: encoding it
raises its `DataError`, which `skip_bad_rows` counts and skips as any other bad row's.
"""

from __future__ import annotations

import codecs
import json
import logging
import random
from pathlib import Path
from typing import Any

from protrain.train.data.config import DatasetConfig
from protrain.train.data.errors import DataError, not_utf8_place
from protrain.train.data.tool_call_form import drop_struct_fill

logger = logging.getLogger("protrain.train.data")

_FORMAT_BY_SUFFIX = {
    ".jsonl": "json",
    ".json": "json",
    ".parquet": "parquet",
    ".csv": "csv",
}


class UnreadableRow(dict):
    """A row's place whose line could not be read as a JSON object; ``problem`` says why."""

    def __init__(self, problem: str) -> None:
        super().__init__()
        self.problem = problem


def _looks_local(path: str) -> bool:
    p = Path(path)
    return (
        path.startswith((".", "/", "~"))
        or p.suffix.lower() in _FORMAT_BY_SUFFIX
        or p.exists()
        or path.count("/") != 1  # hub ids are exactly owner/name
    )


def _read_text(path: Path, dataset: str) -> str:
    """A data file's UTF-8 text; a DataError naming the file (and the line, for bytes that
    are not UTF-8) otherwise."""
    try:
        data = path.read_bytes()
    except OSError as e:
        raise DataError(f"cannot read {path}: {e.strerror or e}", dataset=dataset) from e
    data = data.removeprefix(codecs.BOM_UTF8)  # a byte-order mark is not part of the data
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DataError(
            f"{path} is not UTF-8 text at {not_utf8_place(data, e)}; save it as UTF-8",
            dataset=dataset,
        ) from e


def _read_json_file(path: Path, dataset: str) -> list[dict[str, Any]]:
    text = _read_text(path, dataset)
    rows: list[Any]
    stripped = text.lstrip()
    if path.suffix.lower() == ".json" and stripped.startswith(("[", "{")):
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            if not stripped.startswith("{"):
                raise DataError(f"{path} is not valid JSON: {e}", dataset=dataset) from e
            data = None  # a JSONL file with a .json suffix
        if isinstance(data, list):
            rows = data
        elif isinstance(data, dict) and "data" in data and isinstance(data["data"], list):
            rows = data["data"]
        elif isinstance(data, dict):
            rows = [data]
        else:
            rows = _read_json_lines(text, path, dataset)
    else:
        rows = _read_json_lines(text, path, dataset)
    return [
        row
        if isinstance(row, dict)
        else UnreadableRow(f"expected a JSON object, got {type(row).__name__}")
        for row in rows
    ]


def _read_json_lines(text: str, path: Path, dataset: str) -> list[Any]:
    rows = []
    # lines end at \n only: str.splitlines also splits at U+2028, U+0085, ..., which JSON
    # strings may hold as they are
    for line_no, line in enumerate(text.split("\n")):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as e:
            rows.append(UnreadableRow(f"line {line_no + 1} of {path} is not valid JSON: {e}"))
    return rows


def _read_with_datasets(files: list[Path], fmt: str, dataset: str) -> list[dict[str, Any]]:
    # the config check imports this module: datasets loads where a dataset is read
    import datasets

    try:
        ds = datasets.load_dataset(fmt, data_files=[str(f) for f in files], split="train")
    except Exception as e:  # datasets raises many types for unreadable files
        raise DataError(
            f"cannot read {fmt} file(s) {[str(f) for f in files]}: {e}", dataset=dataset
        ) from e
    return _arrow_rows(ds, dataset)


def _arrow_rows(ds, dataset: str) -> list[dict[str, Any]]:
    """A `datasets` table as rows; tool-call arguments and tool schemas lose the nulls of the
    struct schema (`drop_struct_fill`)."""
    rows = ds.to_list()
    changed = drop_struct_fill(rows)
    if changed:
        logger.warning(
            "dataset %r: %d tool call(s) or tool schema(s) read through Arrow had null fields "
            "(Arrow keeps the objects of a column as one struct of every key seen, so each gets "
            "the others' keys as null); the nulls were dropped (store arguments and tools as "
            "JSON text to keep a genuine null)",
            dataset,
            changed,
        )
    return rows


def _data_files(cfg: DatasetConfig, root: Path) -> list[Path]:
    if cfg.data_files is None:
        files = [f for f in sorted(root.rglob("*")) if f.suffix.lower() in _FORMAT_BY_SUFFIX]
        if not files:
            raise DataError(
                f"folder {root} holds no .jsonl, .json, .parquet or .csv files", dataset=cfg.path
            )
        return files
    names = [cfg.data_files] if isinstance(cfg.data_files, str) else cfg.data_files
    files = []
    for name in names:
        matched = sorted(root.glob(name))
        if not matched:
            raise DataError(
                f"data_files entry {name!r} matches no file under {root}", dataset=cfg.path
            )
        files.extend(matched)
    return files


def _read_local(cfg: DatasetConfig) -> list[dict[str, Any]]:
    path = Path(cfg.path).expanduser()
    if not path.exists():
        # a relative path is the working folder's, not the config file's: say which
        where = "" if path.is_absolute() else f" (looked in the working folder {Path.cwd()})"
        raise DataError(
            f"file or folder {str(path)!r} does not exist{where}", dataset=cfg.path, field="path"
        )
    if path.is_dir():
        if (path / "dataset_info.json").exists() or (path / "dataset_dict.json").exists():
            return _read_saved(path, cfg)
        files = _data_files(cfg, path)
    else:
        files = [path]
    rows: list[dict[str, Any]] = []
    by_format: dict[str, list[Path]] = {}
    for f in files:
        fmt = _FORMAT_BY_SUFFIX.get(f.suffix.lower())
        if fmt is None:
            raise DataError(
                f"{f} has an unknown suffix; expected one of {sorted(_FORMAT_BY_SUFFIX)}",
                dataset=cfg.path,
                field="path",
            )
        by_format.setdefault(fmt, []).append(f)
    for f in by_format.get("json", []):
        rows.extend(_read_json_file(f, cfg.path))
    for fmt in ("parquet", "csv"):
        if by_format.get(fmt):
            rows.extend(_read_with_datasets(by_format[fmt], fmt, cfg.path))
    return rows


def _read_saved(path: Path, cfg: DatasetConfig) -> list[dict[str, Any]]:
    # the config check imports this module: datasets loads where a dataset is read
    import datasets

    try:
        ds = datasets.load_from_disk(str(path))
    except (OSError, ValueError) as e:  # missing or damaged arrow files
        raise DataError(f"cannot read the saved dataset in {path}: {e}", dataset=cfg.path) from e
    if isinstance(ds, datasets.DatasetDict):
        if cfg.split not in ds:
            raise DataError(
                f"split {cfg.split!r} not found; the dataset has {sorted(ds)}",
                dataset=cfg.path,
                field="split",
            )
        ds = ds[cfg.split]
    return _arrow_rows(ds, cfg.path)


def _read_hub(cfg: DatasetConfig) -> list[dict[str, Any]]:
    # the config check imports this module: datasets loads where a dataset is read
    import datasets

    try:
        ds = datasets.load_dataset(cfg.path, cfg.name, split=cfg.split, data_files=cfg.data_files)
    except Exception as e:  # network, auth, missing split: all reported the same way
        raise DataError(
            f"cannot load hub dataset (split {cfg.split!r}): {type(e).__name__}: {e}",
            dataset=cfg.path,
            field="path",
        ) from e
    return _arrow_rows(ds, cfg.path)


def read_rows(cfg: DatasetConfig) -> list[dict[str, Any]]:
    """All rows of one dataset entry, in file order."""
    if _looks_local(cfg.path):
        rows = _read_local(cfg)
    else:
        rows = _read_hub(cfg)
    if not rows:
        raise DataError("the dataset has no rows", dataset=cfg.path)
    return rows


def select_rows(
    rows: list[dict[str, Any]], cfg: DatasetConfig, *, seed: int
) -> list[tuple[int, dict[str, Any]]]:
    """`(row_index, row)` pairs after `shuffle` and `max_samples`; deterministic for a seed."""
    indexed = list(enumerate(rows))
    if cfg.shuffle:
        random.Random(seed).shuffle(indexed)
    if cfg.max_samples is not None:
        indexed = indexed[: cfg.max_samples]
    return indexed
