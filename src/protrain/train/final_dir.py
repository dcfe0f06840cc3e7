"""The exported model's folder (`output_dir/final`): written whole under another name, then
put in place without a moment where neither the old nor the new one exists.

[Note: replacing final]
An export writes `final.tmp` (the single-process export and the streamed one of several
ranks alike), flushes every file and folder of it to disk, then: the old `final`, if any, is
renamed `final.old`; `final.tmp` is renamed `final`; `final.old` is removed. Each rename is
atomic and flushed, so a process killed (or a machine that loses power) at any point leaves
a whole `final`, or a whole `final.old` beside a `final.tmp` that may be partial.
`recover` (run before anything else is done with the output_dir) puts `final.old` back
where no `final` exists and removes it where one does; a leftover `final.tmp` is removed by
the next export. Before, the old `final` was removed before the rename, and a kill between
the two left no model under any name the run knew.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from protrain.train.checkpoint import fsync_path


def tmp_dir(final: Path) -> Path:
    """Where an export writes before `publish`."""
    return final.with_name(final.name + ".tmp")


def _old_dir(final: Path) -> Path:
    return final.with_name(final.name + ".old")


def publish(tmp: Path, final: Path) -> None:
    """Put the written `tmp` in place of `final` (see [Note: replacing final])."""
    _fsync_tree(tmp)
    old = _old_dir(final)
    if old.exists():  # a replaced final that an earlier kill left: `final` is whole
        shutil.rmtree(old)
    if final.exists():
        final.rename(old)
        fsync_path(final.parent)
    tmp.rename(final)
    fsync_path(final.parent)
    shutil.rmtree(old, ignore_errors=True)


def recover(final: Path) -> str | None:
    """Finish a replacement a killed export left (see [Note: replacing final]); a line to
    log, or None where there was nothing to do."""
    old = _old_dir(final)
    if not old.exists():
        return None
    if final.exists():
        shutil.rmtree(old)
        return f"removed {old}, the model an export had already replaced"
    old.rename(final)
    fsync_path(final.parent)
    return (
        f"restored {final} from {old.name}: an export that was replacing it was interrupted; "
        "that export was not completed"
    )


def _fsync_tree(root: Path) -> None:
    """Every file and folder under `root` to disk: `save_pretrained` and the tokenizer's
    writers do not flush, and a rename can reach the disk before the data it names."""
    for folder, _, files in os.walk(root):
        for name in files:
            fsync_path(Path(folder) / name)
        fsync_path(Path(folder))
