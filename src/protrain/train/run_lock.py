"""One run per output directory, and the directory checked before anything is loaded.

[Note: the run lock]
`output_dir/.protrain.lock` is held with `fcntl.flock` for the whole run and names its
holder (host, pid, start time). The kernel drops the lock when the process ends, however it
ends, so a killed run never leaves a stale lock; the file itself stays (deleting a lock file
that another process may be opening would let two runs hold two different files). A second
run on the same folder is refused with one line naming the holder.
"""

from __future__ import annotations

import errno
import fcntl
import os
import shutil
import socket
import time
from pathlib import Path

from protrain.train.errors import OutputDirError

LOCK_NAME = ".protrain.lock"


class RunLock:
    """The lock of one run on `output_dir`; creates the directory if it is missing."""

    def __init__(self, output_dir: Path):
        self.output_dir = output_dir
        self.path = output_dir / LOCK_NAME
        self._fd: int | None = None
        self._created: list[Path] = []  # directories this run created, deepest first

    def acquire(self) -> RunLock:
        out = self.output_dir
        if out.exists() and not out.is_dir():
            raise OutputDirError(f"output_dir {str(out)!r} is a file, not a directory")
        try:
            self._created = [p for p in (out, *out.parents) if not p.exists()]
            out.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:
            raise OutputDirError(_os_problem(out, exc)) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 512, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise OutputDirError(
                f"output_dir {str(out)!r} is in use by another run ({holder}); wait for it to "
                "end, or choose another output_dir"
            ) from None
        started = time.strftime("%Y-%m-%d %H:%M:%S")
        os.ftruncate(fd, 0)
        os.pwrite(
            fd, f"host {socket.gethostname()}, pid {os.getpid()}, since {started}\n".encode(), 0
        )
        self._fd = fd
        return self

    def release(self) -> None:
        """Unlock; directories this run created and left empty (but for the lock) go too."""
        if self._fd is None:
            return
        if self._created and [p.name for p in self.output_dir.iterdir()] == [LOCK_NAME]:
            self.path.unlink()
            for directory in self._created:
                if any(directory.iterdir()):
                    break
                directory.rmdir()
        fcntl.flock(self._fd, fcntl.LOCK_UN)
        os.close(self._fd)
        self._fd = None

    def __enter__(self) -> RunLock:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


def check_free_space(output_dir: Path, needed_bytes: int, what: str) -> None:
    """Refuse, in one line, when `output_dir`'s file system has less than `needed_bytes`."""
    free = shutil.disk_usage(output_dir).free
    if free < needed_bytes:
        raise OutputDirError(
            f"output_dir {str(output_dir)!r} has {_size(free)} free, {what} needs about "
            f"{_size(needed_bytes)}; free some space or choose another output_dir"
        )


def _size(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def _os_problem(out: Path, exc: OSError) -> str:
    if exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return f"output_dir {str(out)!r} is not writable ({exc.strerror})"
    if exc.errno == errno.ENOTDIR:
        return f"output_dir {str(out)!r}: a parent of it is a file, not a directory"
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return f"output_dir {str(out)!r}: no space left on its file system"
    return f"output_dir {str(out)!r} cannot be used: {exc.strerror or exc}"
