"""The `checkpoint-*` directories of an output_dir, whatever their format: naming, the
manifest that makes each one verifiable, the atomic rename into place, pruning, and finding
the newest intact one to resume from. The formats (`plain.py`, `sharded.py`) write their
files into a `.tmp-*` directory and hand it to these steps.

[Note: atomic save]
Everything is written into `.tmp-checkpoint-<step>` next to the final directory and
fsynced; each file is then read back and hashed into `manifest.json`, written last; only
then is the directory renamed into place. So every `checkpoint-*` that exists is complete
and carries the hashes of what was written. A process killed mid-save leaves a `.tmp-*`
directory: `--resume` removes it, or renames it into place when its manifest verifies (a
kill between the manifest and the rename).

[Note: pruning]
A checkpoint leaves the `checkpoint-*` namespace before anything of it is deleted: it is
renamed to `.trash-checkpoint-<step>` (atomic), and only then removed; a kill mid-prune
leaves a `.trash-*` directory that the next save or `--resume` removes. Older checkpoints
are pruned to `save_total_limit` only after the new one is in place and verified, and the
newest checkpoint is never pruned.

[Note: verified resume]
`--resume` hashes every file of the newest checkpoint against its manifest before reading
a byte of it as data. A damaged one (a file missing, truncated or changed, no manifest) is
moved to `.damaged-checkpoint-<step>`, named in one line, and the next older one is tried.
"""

from __future__ import annotations

import errno
import json
import re
import shutil
from pathlib import Path

from protrain.distributed.dcp_flat import CheckpointMismatch, data_files
from protrain.train.checkpoint.disk import fsync_path, hash_files, write_text
from protrain.train.errors import OutputDirError
from protrain.train.log import logger

CHECKPOINT_RE = re.compile(r"^checkpoint-(\d+)$")
TMP_PREFIX = ".tmp-checkpoint-"
TRASH_PREFIX = ".trash-checkpoint-"
DAMAGED_PREFIX = ".damaged-checkpoint-"
MANIFEST = "manifest.json"
PLAIN, SHARDED = "plain", "sharded"
REQUIRED_FILES = {
    PLAIN: ("model.safetensors", "optimizer.safetensors", "rng.safetensors", "state.json"),
    SHARDED: (".metadata", "state.json"),
}
# Room kept free beyond a checkpoint's tensors (state.json, metadata, the file system's own).
SPACE_MARGIN_BYTES = 64 << 20


def list_checkpoints(output_dir: Path) -> list[Path]:
    """Checkpoint directories (complete by construction; see `verify`), oldest first."""
    if not output_dir.is_dir():
        return []
    found = [
        (int(m.group(1)), p) for p in output_dir.iterdir() if (m := CHECKPOINT_RE.match(p.name))
    ]
    return [p for _, p in sorted(found)]


def latest_checkpoint(output_dir: Path) -> Path | None:
    checkpoints = list_checkpoints(output_dir)
    return checkpoints[-1] if checkpoints else None


def checkpoint_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.iterdir() if f.is_file())


def clean_leftovers(output_dir: Path, *, complete_saves: bool = True) -> list[str]:
    """Finish what a killed process left: remove `.trash-*` and unfinished `.tmp-*` saves;
    `complete_saves`: rename a `.tmp-*` save whose manifest verifies into place (else it is
    removed too). One line each, to log."""
    notes = []
    if not output_dir.is_dir():
        return notes
    complete = set(complete_unrenamed_saves(output_dir)) if complete_saves else set()
    for p in sorted(output_dir.iterdir()):
        if p.name.startswith(TRASH_PREFIX):
            shutil.rmtree(p, ignore_errors=True)
            notes.append(f"removed {p}, a checkpoint whose pruning was interrupted")
        elif p in complete:
            final = output_dir / f"checkpoint-{p.name.removeprefix(TMP_PREFIX)}"
            p.rename(final)
            fsync_path(output_dir)
            notes.append(f"completed {final}, a save interrupted before its rename")
        elif p.name.startswith(TMP_PREFIX):
            shutil.rmtree(p, ignore_errors=True)
            notes.append(f"removed {p}, an unfinished checkpoint save")
    return notes


def complete_unrenamed_saves(output_dir: Path) -> list[Path]:
    """The `.tmp-*` saves whose manifest verifies and whose `checkpoint-*` does not exist (a
    kill between the manifest and the rename), oldest first: `--resume` puts them in place
    (`clean_leftovers`)."""
    if not output_dir.is_dir():
        return []
    found = []
    for p in output_dir.iterdir():
        step = p.name.removeprefix(TMP_PREFIX)
        if not (p.name.startswith(TMP_PREFIX) and step.isdigit()):
            continue
        if not (output_dir / f"checkpoint-{step}").exists() and verify(p) is None:
            found.append((int(step), p))
    return [p for _, p in sorted(found)]


def verify(path: Path) -> str | None:
    """None when every file of the checkpoint matches its manifest; else what is wrong."""
    try:
        manifest = json.loads((path / MANIFEST).read_text())
        files = manifest["files"]
        fmt = manifest.get("format", PLAIN)
        expected = {name: (int(f["bytes"]), str(f["sha256"])) for name, f in files.items()}
        required = REQUIRED_FILES[fmt]
    except FileNotFoundError:
        return f"no {MANIFEST}"
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        return f"{MANIFEST} unreadable ({type(exc).__name__})"
    for name in required:
        if name not in expected:
            return f"{MANIFEST} does not list {name}"
    for name, (size, _) in expected.items():
        f = path / name
        if not f.is_file():
            return f"{name} is missing"
        if f.stat().st_size != size:
            return f"{name} has {f.stat().st_size} bytes, {size} were written"
    hashes = hash_files([path / name for name in expected])
    for name, (_, sha) in expected.items():
        if hashes[path / name] != sha:
            return f"{name} does not match its sha256 (changed after it was written)"
    if fmt == SHARDED:  # every rank's file that the metadata points into is listed
        try:
            unlisted = sorted(data_files(path) - set(expected))
        except CheckpointMismatch as exc:
            return str(exc)
        if unlisted:
            return f".metadata points into {unlisted[0]}, which {MANIFEST} does not list"
    return None


def checkpoint_format(path: Path) -> str:
    """`plain` (one process wrote it) or `sharded` (several ranks), from its manifest."""
    try:
        return json.loads((path / MANIFEST).read_text()).get("format", PLAIN)
    except (OSError, ValueError, AttributeError):
        return PLAIN


def find_resume_checkpoint(output_dir: Path) -> Path:
    """The newest checkpoint that verifies; damaged ones are moved aside and named."""
    for note in clean_leftovers(output_dir):
        logger.warning(note)
    damaged = []
    for path in reversed(list_checkpoints(output_dir)):
        problem = verify(path)
        if problem is None:
            for name, why, aside in damaged:  # every one moved aside is named
                logger.warning(
                    "--resume: %s is damaged (%s) and was moved to %s; resuming from %s, the "
                    "newest intact checkpoint",
                    name,
                    why,
                    aside,
                    path.name,
                )
            return path
        aside = move_aside(path)
        damaged.append((path.name, problem, aside.name))
    if not damaged:
        raise OutputDirError(
            f"--resume: no checkpoint-* directory in output_dir {str(output_dir)!r} to resume from"
        )
    names = "; ".join(f"{name}: {problem}" for name, problem, _ in damaged)
    finished = (output_dir / "final").exists()  # a new run there is refused while it stays
    fresh = "in another output_dir" if finished else "without --resume"
    raise OutputDirError(
        f"--resume: no intact checkpoint in output_dir {str(output_dir)!r} ({names}); they "
        f"were moved to {DAMAGED_PREFIX}*; start a new run {fresh}"
        + (" (this one keeps the finished run's final/)" if finished else "")
    )


def trash(path: Path) -> None:
    """Take a checkpoint out of the `checkpoint-*` namespace (atomic); removed later."""
    path.rename(path.with_name(TRASH_PREFIX + path.name.removeprefix("checkpoint-")))
    fsync_path(path.parent)


def remove_trash(output_dir: Path) -> None:
    for p in output_dir.iterdir():
        if p.name.startswith(TRASH_PREFIX):
            shutil.rmtree(p)


def move_aside(path: Path) -> Path:
    """A damaged checkpoint leaves the namespace, kept for inspection."""
    aside = path.with_name(DAMAGED_PREFIX + path.name.removeprefix("checkpoint-"))
    n = 1
    while aside.exists():
        n += 1
        aside = path.with_name(f"{DAMAGED_PREFIX}{path.name.removeprefix('checkpoint-')}.{n}")
    path.rename(aside)
    fsync_path(path.parent)
    return aside


def write_manifest(
    tmp: Path, known: dict[str, tuple[int, str]] | None = None, fmt: str = PLAIN
) -> None:
    """Hash what was written, read back from the files themselves; ``known``: name ->
    (bytes, sha256) of files another rank wrote and hashed (their size checked here)."""
    known = known or {}
    files = sorted(p for p in tmp.iterdir() if p.is_file() and p.name != MANIFEST)
    for p in files:
        if p.name in known and p.stat().st_size != known[p.name][0]:
            raise OSError(
                errno.EIO, f"{p} has {p.stat().st_size} bytes, its rank wrote {known[p.name][0]}"
            )
    hashes = hash_files([p for p in files if p.name not in known])
    hashes.update({tmp / name: sha for name, (_, sha) in known.items()})
    manifest = {
        "format": fmt,
        "files": {p.name: {"bytes": p.stat().st_size, "sha256": hashes[p]} for p in files},
    }
    if fmt == PLAIN:  # the plain format's manifest, as it always was
        del manifest["format"]
    write_text(tmp / MANIFEST, json.dumps(manifest, indent=1))


def check_sizes(path: Path) -> str | None:
    """The manifest lists every file with its size (the hashes were taken from the files
    just before): the check around a save's rename."""
    try:
        files = json.loads((path / MANIFEST).read_text())["files"]
    except (OSError, ValueError, KeyError) as exc:
        return f"{MANIFEST} unreadable ({type(exc).__name__})"
    for name, f in files.items():
        if not (path / name).is_file() or (path / name).stat().st_size != f["bytes"]:
            return f"{name} does not match {MANIFEST}"
    return None


def space_needed_bytes(tensor_bytes: int) -> int:
    """The free space a checkpoint of ``tensor_bytes`` of tensors asks for: the check at
    start-up (on an estimate) and the check of every save (on the exact size) alike."""
    return tensor_bytes + SPACE_MARGIN_BYTES


def newest_note(output_dir: Path) -> str:
    newest = latest_checkpoint(output_dir)
    return f"{newest.name} is the newest checkpoint" if newest else "no checkpoint was saved yet"


def next_run(output_dir: Path) -> str:
    """What continues after space was freed: a resume, or (nothing saved) the run again."""
    return "resume" if latest_checkpoint(output_dir) else "run it again"
