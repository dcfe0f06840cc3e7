"""Small configs for the training tests: the `tiny` model on the quickstart data."""

from __future__ import annotations

import subprocess
import sys
import textwrap
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


def signal_inside(function: str, **config: Any) -> str:
    """A script (for ``python -c SCRIPT TMP_PATH``) that trains ``tiny_config(TMP_PATH,
    **config)`` and sends itself SIGTERM as the loop's ``function`` (``loop.export``,
    ``loop.evaluate``) starts; tests edit it with ``str.replace`` for other moments."""
    return textwrap.dedent(
        f"""
        import os, signal, sys
        from pathlib import Path
        import protrain.train.loop as loop
        from protrain.train.config import validate_config
        from tests.train.helpers import tiny_config

        real_{function} = loop.{function}

        def {function}(*args, **kwargs):
            os.kill(os.getpid(), signal.SIGTERM)
            return real_{function}(*args, **kwargs)

        loop.{function} = {function}
        cfg = tiny_config(Path(sys.argv[1]), **{config!r})
        loop.train(validate_config(cfg))
        """
    )


def run_script(script: str, tmp_path: Path, env: dict[str, str] | None = None):
    """``python -c script tmp_path`` from the repository root, output captured."""
    return subprocess.run(
        [sys.executable, "-c", script, str(tmp_path)],
        cwd=Path(__file__).resolve().parents[2],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


def save_families(root: Path, *names: str) -> Path:
    """Tiny random checkpoints of the family matrix's ``names`` under ``root/<name>``."""
    from tests.families.configs import build  # the family matrix: only the tests that save

    for name in names:
        build(name).save_pretrained(root / name)
    return root
