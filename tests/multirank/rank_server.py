"""Run `protrain` on several CPU ranks quickly: a server imports protrain once, then forks
one process per rank with torchrun's environment (as `tests/train/cli_server.py` does for
one process), so that a test can launch many short jobs, and kill ranks, without paying
the imports each time. The server plays torchrun's part in one respect: once a rank has
died, it kills the others.

A rank whose environment holds `KILL_AT="<file>:<n>"` SIGKILLs itself just before it writes
`<file>` for the nth time (`checkpoint.sharded.before_write`), or, for `_trash:<n>`, right
after the nth checkpoint leaves the namespace while pruning (`checkpoint.directory.trash`). With
`EXPORT_TWICE="<max_shard_size>"` the final export of several ranks is written twice:
streamed (`final/`) and gathered as before streaming (`final-gathered/`), both split into
files of at most that size. With `EXPORT_GATHERED=1` it is never streamed (as for a model
whose names transformers converts on save): rank 0 writes the gathered model.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

SERVER = r"""
import json, os, signal, sys
import torch
import protrain.train.loop, protrain.cli, transformers, peft  # the imports, paid once
import protrain.train.fsdp2_trainable
from protrain.cli import main

def install_kill(spec):
    # "name:n": SIGKILL just before this rank writes file `name` for the nth time; "_trash:n":
    # right after the nth checkpoint leaves the namespace in pruning
    import protrain.train.checkpoint.directory as directory
    import protrain.train.checkpoint.sharded as sharded
    name, n = spec.rsplit(":", 1)
    seen = [0]
    def count(what):
        if what == name:
            seen[0] += 1
            if seen[0] == int(n):
                os.kill(os.getpid(), signal.SIGKILL)
    sharded.before_write = count
    real_trash = directory.trash
    def trash(path):
        real_trash(path)
        count("_trash")
    directory.trash = trash

def install_export_twice(max_shard_size):
    # the streamed export split at `max_shard_size`, then the gathered one (the engine
    # closed, rank 0's save_pretrained) into final-gathered, for a test to compare
    import protrain.train.checkpoint.streamed_export as streamed
    real = streamed.export_streamed
    def twice(trainable, tokenizer, final_dir, ranks, **kwargs):
        real(trainable, tokenizer, final_dir, ranks, **kwargs, max_shard_size=max_shard_size)
        model = trainable.export_model()
        if ranks.is_main:
            model.save_pretrained(final_dir.with_name("final-gathered"),
                                  safe_serialization=True, max_shard_size=max_shard_size)
            tokenizer.save_pretrained(final_dir.with_name("final-gathered"))
    streamed.export_streamed = twice

def child(request):
    fd = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.environ.update(request["env"])
    torch.set_num_threads(1)
    if os.environ.get("KILL_AT"):
        install_kill(os.environ["KILL_AT"])
    if os.environ.get("EXPORT_TWICE"):
        install_export_twice(os.environ["EXPORT_TWICE"])
    if os.environ.get("EXPORT_GATHERED"):
        import protrain.train.checkpoint.streamed_export as streamed
        streamed.streamable = lambda trainable: "forced by the test"
    try:
        code = main(request["argv"])
    except SystemExit as exc:
        code = exc.code
    sys.stdout.flush(); sys.stderr.flush()
    os._exit(code if isinstance(code, int) else 1)

for line in sys.stdin:
    request = json.loads(line)
    if "poll" in request:
        pid, status = os.waitpid(request["poll"], os.WNOHANG)
        code = os.waitstatus_to_exitcode(status) if pid else None
        print(json.dumps({"status": code}), flush=True)
        continue
    pid = os.fork()
    if pid == 0:
        child(request)
    print(json.dumps({"pid": pid}), flush=True)
"""


class RankServer:
    def __init__(self) -> None:
        env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}
        self.proc = subprocess.Popen(
            [sys.executable, "-c", SERVER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            text=True, env=env,
        )  # fmt: skip

    def _ask(self, request: dict) -> dict:
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError("the rank server died")
        return json.loads(line)

    def run(
        self,
        world: int,
        argv: list[str],
        logs: Path,
        kill: tuple[int, str] | None = None,
        env: dict[str, str] | None = None,
    ):
        """`protrain <argv>` on `world` ranks, ``env`` added to each rank's environment; when
        one dies the others are killed (as torchrun does). The exit status of each rank."""
        extra, port = env, _free_port()
        pids = []
        for rank in range(world):
            env = {
                "RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
                "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port),
            }  # fmt: skip
            if world == 1:
                env = {"WORLD_SIZE": "1"}
            if kill is not None and kill[0] == rank:
                env["KILL_AT"] = kill[1]
            log = logs.with_name(f"{logs.name}.rank{rank}.log")
            request = {"argv": argv, "log": str(log), "env": {**env, **(extra or {})}}
            pids.append(self._ask(request)["pid"])
        status: dict[int, int] = {}
        deadline = time.monotonic() + 240
        while len(status) < world:
            assert time.monotonic() < deadline, f"ranks still running: {status}"
            for pid in pids:
                if pid not in status:
                    code = self._ask({"poll": pid})["status"]
                    if code is not None:
                        status[pid] = code
            if any(code != 0 for code in status.values()):
                for pid in pids:
                    if pid not in status:
                        os.kill(pid, signal.SIGKILL)
            time.sleep(0.05)
        return [status[pid] for pid in pids]

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
