"""One line for the job when a rank of a `torchrun` launch fails or dies.

A rank that raises ends its process; the others learn of it only as a failed collective
(gloo: "Connection closed by peer"), and a rank killed outright (SIGKILL, the kernel's
out-of-memory killer) says nothing at all. So that the job ends with one line a node
(which rank, what happened, the newest intact checkpoint, the command that resumes) and
not with the survivors' collective tracebacks:

- every rank records its process id in the launcher's key-value store as it joins;
- a rank that fails records what happened (`record_failure`) before it exits, so the
  record is there before its connections close;
- a survivor whose collective fails asks `peer_failure`: the record, or else the rank of
  its own node whose process is gone. One rank a node prints the line: the failed rank
  itself on its node, else the lowest live local rank.

The store is torchrun's own (``TORCHELASTIC_USE_AGENT_STORE``: the agent serves it, so it
outlives the ranks); under another launcher nothing is recorded and a failed collective
keeps its traceback.
"""

from __future__ import annotations

import datetime
import json
import os
import socket
from dataclasses import dataclass
from pathlib import Path

import torch.distributed as dist

from protrain.train.stop_signals import resume_command

_CONNECT_TIMEOUT_S = 10
_PF_EXITING = 0x4  # linux/sched.h: the task is in its exit


@dataclass(frozen=True)
class _Member:
    """This rank's place in the job and its connection to the launcher's store."""

    store: dist.Store
    prefix: str  # one attempt's keys (torchrun may restart the ranks)
    rank: int
    local_rank: int
    node: int


@dataclass(frozen=True)
class PeerFailure:
    """Another rank's failure, as a survivor sees it."""

    line: str  # the job's one line, without "error: "
    prints_here: bool  # whether this rank prints it for its node


_member: _Member | None = None
_newest_checkpoint: Path | None = None


def join() -> None:
    """Record this rank's process in the launcher's store (under torchrun only)."""
    global _member
    env = os.environ
    if env.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return
    store = dist.TCPStore(
        env["MASTER_ADDR"],
        int(env["MASTER_PORT"]),
        is_master=False,
        timeout=datetime.timedelta(seconds=_CONNECT_TIMEOUT_S),
        wait_for_workers=False,
    )
    prefix = f"protrain/{env.get('TORCHELASTIC_RUN_ID', '')}/{env.get('TORCHELASTIC_RESTART_COUNT', '0')}/"
    _member = _Member(
        store=store,
        prefix=prefix,
        rank=int(env["RANK"]),
        local_rank=int(env.get("LOCAL_RANK", "0")),
        node=int(env.get("GROUP_RANK", "0")),
    )
    record = {"host": socket.gethostname(), "pid": os.getpid(), "node": _member.node}
    store.set(f"{prefix}rank/{_member.rank}", json.dumps(record))


def begin_run() -> None:
    """A new run (or CLI command) in this process: no checkpoint of an earlier one is named."""
    global _newest_checkpoint
    _newest_checkpoint = None


def note_checkpoint(path: Path | None) -> None:
    """The newest intact checkpoint of this run (saved by every rank, or resumed from)."""
    global _newest_checkpoint
    if path is not None:
        _newest_checkpoint = path


def what_is_kept() -> str:
    """The newest intact checkpoint and the command that resumes from it; "" when none
    was saved."""
    if _newest_checkpoint is None:
        return ""
    return f"{_newest_checkpoint} is the newest intact checkpoint; resume with: {resume_command()}"


def _kept_or_none() -> str:
    return what_is_kept() or "no checkpoint was saved"


def record_failure(what: str) -> None:
    """Record, for the other ranks, that this rank fails with ``what``; the first record
    of the job stands (a rank failing after another failed is a consequence)."""
    if _member is None:
        return
    m = _member
    try:
        if m.store.add(f"{m.prefix}failures", 1) == 1:
            record = {"rank": m.rank, "node": m.node, "what": what}
            m.store.set(f"{m.prefix}failed", json.dumps(record))
    except Exception:  # the store (node 0's agent) may be gone with its node
        pass


def peer_failure() -> PeerFailure | None:
    """Another rank's failure, which a collective of this rank just met; None when no
    other rank is known to have failed (the error is then this rank's own)."""
    if _member is None:
        return None
    m = _member
    try:
        if m.store.check([f"{m.prefix}failed"]):
            failed = json.loads(m.store.get(f"{m.prefix}failed"))
            line = f"rank {failed['rank']} failed: {failed['what']}; {_kept_or_none()}"
            # the failed rank prints its own error on its node
            prints_here = failed["node"] != m.node and _lowest_live_local_rank(m) == m.local_rank
            return PeerFailure(line=line, prints_here=prints_here)
        dead = _dead_ranks_of_this_node(m)
    except Exception:  # the store (node 0's agent) may be gone with its node
        return None
    if not dead:
        return None
    rank, pid = dead[0]
    line = (
        f"rank {rank} (pid {pid}) ended without an error of its own: it was killed (SIGKILL, "
        f"or the out-of-memory killer: see `dmesg`); {_kept_or_none()}"
    )
    return PeerFailure(line=line, prints_here=_lowest_live_local_rank(m) == m.local_rank)


def _ranks_of_this_node(m: _Member) -> list[tuple[int, int]]:
    """(rank, pid) of every rank of this node that recorded itself."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    keys = [f"{m.prefix}rank/{r}" for r in range(world)]
    found = []
    for rank, key in enumerate(keys):
        if not m.store.check([key]):
            continue
        record = json.loads(m.store.get(key))
        if record["node"] == m.node and record["host"] == socket.gethostname():
            found.append((rank, record["pid"]))
    return found


def _dead_ranks_of_this_node(m: _Member) -> list[tuple[int, int]]:
    return [(r, pid) for r, pid in _ranks_of_this_node(m) if not _alive(pid)]


def _lowest_live_local_rank(m: _Member) -> int:
    """The local rank that speaks for this node: the lowest whose process still runs
    (ranks of a node are numbered in the order of their local ranks)."""
    live = [r for r, pid in _ranks_of_this_node(m) if _alive(pid)]
    if not live:
        return m.local_rank
    return m.local_rank - (m.rank - min(live))


def _alive(pid: int) -> bool:
    """Whether process ``pid`` runs: not a zombie (ended, not yet reaped by torchrun), and
    not exiting. A killed process closes its sockets while it exits, before it is a
    zombie, so a survivor's collective can fail while the killed rank is still listed;
    the kernel marks it PF_EXITING from the start of its exit."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return False
    state, flags = fields[0], int(fields[6])
    return state not in ("Z", "X") and not flags & _PF_EXITING
