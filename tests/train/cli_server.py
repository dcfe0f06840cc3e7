"""Run `protrain` CLI processes quickly: a server imports protrain once, then forks one child
per run, so that a test can start (and `kill -9`) many runs without paying the imports each
time. The server itself runs no torch op before forking. `CliServer()` returns once the
imports are done, so that the first run's start-up is as short as the later ones' (tests time
it to choose when to kill).

Protocol (one JSON line each way, after the server's {"ready": true}): {"argv": [...], "log":
path, "env": {...}} starts a child with stdout and stderr to `log` and answers {"pid": N};
{"wait": N} answers {"status": S} (the exit status, or -signal for a child killed by one).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

SERVER = r"""
import json, os, signal, sys
import protrain.train.loop, protrain.cli, transformers, peft  # the imports, paid once
from protrain.cli import main
print(json.dumps({"ready": True}), flush=True)

def child(request):
    fd = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.environ.update(request.get("env", {}))
    sys.argv = request["argv"]
    # DIE_AT="module.function:n:before|after": SIGKILL at the nth call of
    # protrain.train.checkpoint.module.function
    die_at = os.environ.get("DIE_AT")
    if die_at:
        import importlib
        target, n, when = die_at.split(":")
        module, name = target.rsplit(".", 1)
        ckpt = importlib.import_module(f"protrain.train.checkpoint.{module}")
        real, calls = getattr(ckpt, name), [0]
        def dying(*args, **kwargs):
            calls[0] += 1
            if calls[0] == int(n) and when == "before":
                os.kill(os.getpid(), signal.SIGKILL)
            out = real(*args, **kwargs)
            if calls[0] == int(n) and when == "after":
                os.kill(os.getpid(), signal.SIGKILL)
            return out
        setattr(ckpt, name, dying)
    try:
        code = main(sys.argv[1:])
    except SystemExit as exc:
        code = exc.code
    sys.stdout.flush(); sys.stderr.flush()
    os._exit(code if isinstance(code, int) else 1)

for line in sys.stdin:
    request = json.loads(line)
    if "wait" in request:
        _, status = os.waitpid(request["wait"], 0)
        code = os.waitstatus_to_exitcode(status)
        print(json.dumps({"status": code}), flush=True)
        continue
    pid = os.fork()
    if pid == 0:
        child(request)
    print(json.dumps({"pid": pid}), flush=True)
"""


class CliServer:
    def __init__(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", SERVER],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env={**os.environ, "TOKENIZERS_PARALLELISM": "false"},
        )
        if self._read() != {"ready": True}:
            raise RuntimeError("the CLI server did not start")

    def _ask(self, request: dict) -> dict:
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def _read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError("the CLI server died")
        return json.loads(line)

    def start(self, args: list[str], log: Path, env: dict | None = None) -> int:
        """Start `protrain <args>` (sys.argv as the console script has it); its pid."""
        argv = [str(Path(sys.executable).with_name("protrain")), *args]
        return self._ask({"argv": argv, "log": str(log), "env": env or {}})["pid"]

    def wait(self, pid: int) -> int:
        return self._ask({"wait": pid})["status"]

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=60)
