"""The exported model's folder (`output_dir/final`): written whole under another name, then
put in place without a moment where neither the old nor the new one exists.

[Note: replacing final]
An export writes `final.tmp` (the single-process export and the streamed one of several
ranks alike), flushes every file and folder of it to disk, then: the old `final`, if any, is
renamed `final.old`; `final.tmp` is renamed `final`; `final.old` is removed. Each rename is
flushed, so a process killed (or a machine that loses power) at any point leaves one of:
a `final` (with a `final.old` beside it, or a partial `final.tmp` from an export that had
not reached its renames), or a `final.old` beside a whole `final.tmp` (the new model, on
disk before the old one was moved). `recover`, run before the output_dir is used and at
the start of every `publish`, finishes the replacement in the second case, removes a
leftover `final.old` in the first, and removes a `final.tmp` that no `final.old` vouches
for (a partial export).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from protrain.train.checkpoint.disk import fsync_path


def tmp_dir(final: Path) -> Path:
    """Where an export writes before `publish`."""
    return final.with_name(final.name + ".tmp")


def _old_dir(final: Path) -> Path:
    return final.with_name(final.name + ".old")


def publish(tmp: Path, final: Path) -> None:
    """Put the written `tmp` in place of `final` (see [Note: replacing final])."""
    _fsync_tree(tmp)
    old = _old_dir(final)
    if old.exists():  # an earlier replacement a kill cut short: `final` is whole after it
        _finish(final, old, tmp=None)
    if final.exists():
        final.rename(old)
        fsync_path(final.parent)
    tmp.rename(final)
    fsync_path(final.parent)
    shutil.rmtree(old, ignore_errors=True)


def recover(final: Path) -> str | None:
    """Finish what a killed export left (see [Note: replacing final]); a line to log, or
    None where there was nothing to do."""
    old, tmp = _old_dir(final), tmp_dir(final)
    if old.exists():
        return _finish(final, old, tmp if tmp.exists() else None)
    if tmp.exists():
        shutil.rmtree(tmp)
        return f"removed {tmp}, an export that did not finish"
    return None


def _finish(final: Path, old: Path, tmp: Path | None) -> str:
    if final.exists():  # killed after the new final was in place
        shutil.rmtree(old)
        return f"removed {old}, the model an export had already replaced"
    if tmp is not None:  # killed between the renames: the new model is whole on disk
        tmp.rename(final)
        fsync_path(final.parent)
        shutil.rmtree(old)
        return f"completed {final} from {tmp.name}: its export was interrupted between renames"
    old.rename(final)  # the new one is gone (removed by hand): the old one is kept
    fsync_path(final.parent)
    return f"restored {final} from {old.name}"


def _fsync_tree(root: Path) -> None:
    """Every file and folder under `root` to disk: `save_pretrained` and the tokenizer's
    writers do not flush, and a rename can reach the disk before the data it names."""
    for folder, _, files in os.walk(root):
        for name in files:
            fsync_path(Path(folder) / name)
        fsync_path(Path(folder))
