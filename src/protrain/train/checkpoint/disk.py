"""File-system steps every checkpoint and export writer shares: a write that reaches the
disk (fsync of files and directory entries), sha256 of written files, and I/O errors named
as what they are (a full disk, safetensors' wrapped OS errors)."""

from __future__ import annotations

import errno
import hashlib
import os
import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from safetensors import SafetensorError

_HASH_BLOCK_BYTES = 16 << 20
# The error numbers of a full disk (no space, or the user's quota reached).
NO_SPACE = (errno.ENOSPC, errno.EDQUOT)


def fsync_path(path: Path) -> None:
    """Flush a file or a directory entry to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_text(path: Path, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def hash_files(paths: list[Path]) -> dict[Path, str]:
    """sha256 of each file, files in parallel (hashlib releases the GIL)."""
    if not paths:
        return {}
    with ThreadPoolExecutor(max_workers=min(4, len(paths))) as pool:
        return dict(zip(paths, pool.map(_sha256, paths), strict=True))


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(_HASH_BLOCK_BYTES):
            h.update(block)
    return h.hexdigest()


def is_no_space(exc: OSError) -> bool:
    return exc.errno in NO_SPACE


def as_os_error(exc: BaseException, path: Path) -> OSError | None:
    """safetensors' I/O errors as the OSError they are (its writer reports them as
    `SafetensorError` with the OS's error inside the text); None for any other error."""
    if isinstance(exc, OSError):
        return exc
    if not isinstance(exc, SafetensorError):
        return None
    code = re.search(r"os error (\d+)|Os \{ code: (\d+)", str(exc))
    if code is None:
        return None
    number = int(code[1] or code[2])
    return OSError(number, os.strerror(number), str(path))


def format_size(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"
