"""One result row: printed as a JSON line, and appended to a results file when one is named."""

from __future__ import annotations

import json
from pathlib import Path


def emit(row: dict, out: str | Path | None) -> None:
    print(json.dumps(row))
    if out:
        with open(out, "a") as f:
            f.write(json.dumps(row) + "\n")
