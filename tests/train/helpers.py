"""Small configs for the training tests: the `tiny` model on the quickstart data."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from protrain.train.config import QUICKSTART_DIR

QUICKSTART_DATA = QUICKSTART_DIR / "data" / "chat.jsonl"


def tiny_config(tmp_path: Path, **overrides: Any) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "model": {"name_or_path": "tiny"},
        "datasets": [{"path": str(QUICKSTART_DATA), "type": "chat"}],
        "sequence_len": 64,
        "micro_batch_size": 4,
        "gradient_accumulation_steps": 2,
        "max_steps": 10,
        "learning_rate": 1e-3,
        "lr_scheduler": "cosine",
        "warmup_steps": 2,
        "logging_steps": 1,
        "output_dir": str(tmp_path / "run"),
        "seed": 7,
    }
    cfg.update(overrides)
    return cfg


def write_config(tmp_path: Path, cfg: dict[str, Any], name: str = "config.yaml") -> Path:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(cfg))
    return path
