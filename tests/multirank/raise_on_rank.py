"""`protrain train` with rank 1 raising in its third optimizer step: a rank that fails while
the others wait in a collective (tests/multirank/test_train_ranks.py). With
RAISE_ON_RANK=data, the error is a user error (a DataError), which the application reports
in one `error:` line."""

import os
import sys

from protrain.cli import main
from protrain.train import trainable
from protrain.train.data import DataError

_step = trainable.EngineTrainable.optimizer_step
_count = {"steps": 0}


def _failing_step(self) -> None:
    _count["steps"] += 1
    if os.environ.get("RANK") == "1" and _count["steps"] == 3:
        kind = DataError if os.environ.get("RAISE_ON_RANK") == "data" else RuntimeError
        raise kind("rank 1 failed on purpose at step 3")
    _step(self)


trainable.EngineTrainable.optimizer_step = _failing_step
sys.exit(main(sys.argv[1:]))
