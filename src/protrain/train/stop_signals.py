"""SIGINT and SIGTERM during training: stop at the next step boundary, saved and resumable.
During the export that follows the last step, they let the export finish (`finishing`).

The first signal only sets `requested`; the loop sees it after the step in progress, saves
a checkpoint, prints the command that resumes and exits with 128 + the signal's number (130
for SIGINT, 143 for SIGTERM), as a process killed by that signal would. A second signal
ends the process at once, even inside a long kernel or write (a save it interrupts is a
`.tmp-*` directory that `--resume` removes, see [Note: atomic save] in checkpoint.py),
unless it comes within `REPEAT_WINDOW_S` of the first: see [Note: repeated signals].
"""

from __future__ import annotations

import os
import shlex
import signal
import sys
import threading
import time
from pathlib import Path

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)

# [Note: repeated signals]
# One stop request often arrives twice within milliseconds: SLURM (scancel, the time
# limit) and `systemctl stop` signal every process of the job, and torchrun (or srun)
# forwards the signal it got to its workers as well; a terminal's Ctrl-C reaches torchrun
# and its workers alike. A second signal within REPEAT_WINDOW_S of the first is therefore
# the same request: logged once, nothing more. The first signal's handler waits the
# window out (the stop is that much later, once) and then puts both signals back to their
# default action, so a signal after the window ends the process at once whatever the main
# thread is doing, as a Python handler could not while a long kernel or write runs. Under
# torchrun the rule is the same: a second Ctrl-C makes torchrun send its workers another
# SIGTERM, and a person pressing it means "now" (torchrun would SIGKILL them only after
# its --shutdown_timeout). 2 s: torchrun's copy came 1 ms after the direct signal on a
# loaded 2-core host (1,000 times that is margin for a host far busier), and a person
# who presses again after reading the first line is past it.
REPEAT_WINDOW_S = 2.0


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
        # the stop asked for, by this process's first signal or by the ranks' agreement
        self.requested: int | None = None
        self._received_s: float | None = None  # when this process's first signal came
        self._repeat_noted = False
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
        # os.write: no lock that the interrupted code may hold (as logging's)
        name = signal.Signals(signum).name
        if self._received_s is not None:  # within the window: the first handler still waits
            if not self._repeat_noted:
                self._repeat_noted = True
                os.write(
                    2,
                    f"[protrain WARNING] {name} again within {REPEAT_WINDOW_S:g} s: the same "
                    "stop (a launcher's copy)\n".encode(),
                )
            return
        self._received_s = time.monotonic()
        self.requested = signum
        what = (
            "stopping after this step and saving a checkpoint"
            if self.finishing is None
            else f"finishing {self.finishing} first"
        )
        os.write(
            2,
            f"\n[protrain WARNING] {name}: {what}; another Ctrl-C or SIGTERM, "
            f"{REPEAT_WINDOW_S:g} s from now on, ends at once\n".encode(),
        )
        # Repeats during the wait run this handler nested (above); sleep resumes after them.
        time.sleep(REPEAT_WINDOW_S)
        for s in STOP_SIGNALS:
            signal.signal(s, signal.SIG_DFL)


def resume_command(argv: list[str] | None = None, env: dict[str, str] | None = None) -> str:
    """The command that resumes this run: the command line with `--resume`, under torchrun
    when the run has several ranks (one process is refused: another global batch)."""
    argv = list(sys.argv if argv is None else argv)
    env = dict(os.environ if env is None else env)
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
    world_size = int(env.get("WORLD_SIZE", "1"))
    if world_size <= 1:
        return shlex.join(head + args)
    if "TORCHELASTIC_RUN_ID" not in env:  # another launcher: its command line is unknown
        return f"your launcher's command for the {world_size} ranks, running: " + shlex.join(
            ["python", "-m", "protrain", *args]
        )
    per_node = env.get("LOCAL_WORLD_SIZE", str(world_size))
    nodes = int(env.get("GROUP_WORLD_SIZE", "1"))
    if nodes <= 1:
        return shlex.join(["torchrun", "--nproc-per-node", per_node, "-m", "protrain", *args])
    # the rendezvous options (endpoint, node rank) are the launch line's, not known here
    return (
        f"torchrun --nnodes {nodes} --nproc-per-node {per_node} <your rendezvous options> "
        f"{shlex.join(['-m', 'protrain', *args])}, on each node"
    )
