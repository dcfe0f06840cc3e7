"""`protrain train` with rank 1 raising in its third optimizer step: a rank that fails while
the others wait in a collective (tests/multirank/test_train_ranks.py)."""

import os
import sys

from protrain.cli import main
from protrain.train import trainable

_step = trainable.EngineTrainable.optimizer_step
_count = {"steps": 0}


def _failing_step(self) -> None:
    _count["steps"] += 1
    if os.environ.get("RANK") == "1" and _count["steps"] == 3:
        raise RuntimeError("rank 1 failed on purpose at step 3")
    _step(self)


trainable.EngineTrainable.optimizer_step = _failing_step
sys.exit(main(sys.argv[1:]))
