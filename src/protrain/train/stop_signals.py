"""SIGINT and SIGTERM during training: stop at the next step boundary, saved and resumable.
During the export that follows the last step, they let the export finish (`finishing`).

The first signal only sets `requested`; the loop sees it after the step in progress, saves
a checkpoint, prints the command that resumes and exits with 128 + the signal's number (130
for SIGINT, 143 for SIGTERM), as a process killed by that signal would. The handler also
puts both signals back to their default action, so that a second one ends the process at
once, even inside a long kernel: a save it interrupts is a `.tmp-*` directory that
`--resume` removes (see [Note: atomic save] in checkpoint.py).
"""

from __future__ import annotations

import os
import shlex
import signal
import sys
import threading
from pathlib import Path

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class TrainingStopped(SystemExit):
    """The run stopped on a signal after saving; the exit status is 128 + the signal."""

    def __init__(self, signum: int):
        super().__init__(128 + signum)
        self.signum = signum


class StopSignals:
    """Within `with`: SIGINT and SIGTERM ask the loop to stop (main thread only)."""

    def __init__(self, finishing: str | None = None) -> None:
        """``finishing``: what the first signal lets finish instead of the step in progress
        (the loop then sees ``requested`` after it)."""
        self.finishing = finishing
        self.requested: int | None = None
        self._previous: dict[int, object] = {}

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            for s in STOP_SIGNALS:
                self._previous[s] = signal.signal(s, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._previous.clear()

    def _handle(self, signum: int, frame) -> None:
        self.requested = signum
        for s in STOP_SIGNALS:
            signal.signal(s, signal.SIG_DFL)
        # os.write: no lock that the interrupted code may hold (as logging's)
        what = (
            "stopping after this step and saving a checkpoint"
            if self.finishing is None
            else f"finishing {self.finishing} first"
        )
        os.write(
            2,
            f"\n[protrain WARNING] {signal.Signals(signum).name}: {what}; a second Ctrl-C or "
            "SIGTERM ends at once\n".encode(),
        )


def resume_command(argv: list[str] | None = None) -> str:
    """The command that resumes this run: the command line with `--resume`."""
    argv = list(sys.argv if argv is None else argv)
    prog = Path(argv[0]).name if argv else ""
    if prog == "__main__.py":
        head = ["python", "-m", "protrain"]
    elif prog == "protrain":
        head = ["protrain"]
    else:  # not the CLI (train() called from Python)
        return "train(cfg, resume=True)"
    args = argv[1:]
    if "--resume" not in args:
        args.append("--resume")
    return shlex.join(head + args)
