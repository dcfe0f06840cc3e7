"""Resumable training checkpoints: atomic, verified, read without unpickling.

Layout of `output_dir/checkpoint-<step>/`, written by one process (the plain format):
    model.safetensors      trainable parameters (all of them for full fine-tuning), fp32 master
    optimizer.safetensors  every tensor of the optimizer state, keyed `state.<index>.<name>`
    rng.safetensors        torch CPU and CUDA generator states
    state.json             step, data position, optimizer param groups and scalar state,
                           scheduler state, Python and NumPy RNG states
    manifest.json          every other file's size and sha256

Written by several ranks of the chunked engine, the sharded format (`sharded_checkpoint.py`):
`.metadata` and one `__<rank>_0.distcp` per rank (torch.distributed.checkpoint) in place of
the three safetensors files, `state.json` and `manifest.json` as above (the manifest says
`"format": "sharded"`). Both formats load at any world size and mode.

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
import hashlib
import json
import os
import random
import re
import shutil
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from protrain.train.errors import OutputDirError
from protrain.train.log import logger
from protrain.train.nonfinite import assert_finite

FORMAT_VERSION = 1
CHECKPOINT_RE = re.compile(r"^checkpoint-(\d+)$")
TMP_PREFIX = ".tmp-checkpoint-"
TRASH_PREFIX = ".trash-checkpoint-"
DAMAGED_PREFIX = ".damaged-checkpoint-"
MANIFEST = "manifest.json"
PLAIN, SHARDED = "plain", "sharded"
_REQUIRED = {
    PLAIN: ("model.safetensors", "optimizer.safetensors", "rng.safetensors", "state.json"),
    SHARDED: (".metadata", "state.json"),
}
_HASH_BLOCK_BYTES = 16 << 20
# Room kept free beyond a checkpoint's tensors (state.json, metadata, the file system's own).
_SPACE_MARGIN_BYTES = 64 << 20


@dataclass
class Checkpoint:
    path: Path
    step: int
    model_state: dict[str, torch.Tensor]
    optimizer_state: dict[str, Any]
    scheduler_state: dict[str, Any]
    trainer_state: dict[str, Any]
    rng_tensors: dict[str, torch.Tensor]
    rng_python: Any
    rng_numpy: Any


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
        required = _REQUIRED[fmt]
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
    hashes = _hash_files([path / name for name in expected])
    for name, (_, sha) in expected.items():
        if hashes[path / name] != sha:
            return f"{name} does not match its sha256 (changed after it was written)"
    if fmt == SHARDED:  # every rank's file that the metadata points into is listed
        from protrain.distributed.dcp_flat import CheckpointMismatch, data_files

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
        aside = _move_aside(path)
        damaged.append((path.name, problem, aside.name))
    if not damaged:
        raise OutputDirError(
            f"--resume: no checkpoint-* directory in output_dir {str(output_dir)!r} to resume from"
        )
    names = "; ".join(f"{name}: {problem}" for name, problem, _ in damaged)
    raise OutputDirError(
        f"--resume: no intact checkpoint in output_dir {str(output_dir)!r} ({names}); they "
        f"were moved to {DAMAGED_PREFIX}*; start a new run without --resume"
    )


def save_checkpoint(
    output_dir: Path,
    step: int,
    *,
    model_state: dict[str, torch.Tensor],
    optimizer_state: dict[str, Any],
    scheduler_state: dict[str, Any],
    trainer_state: dict[str, Any],
    save_total_limit: int | None,
    param_names: list[str] | None = None,
) -> Path:
    """Write checkpoint-`step` atomically, verified; then prune older ones (see the Notes).
    `param_names`: the parameter name of each optimizer index (kept in state.json, for
    `protrain convert-checkpoint`)."""
    assert_finite(model_state, f"checkpoint-{step}")
    output_dir.mkdir(parents=True, exist_ok=True)
    final = output_dir / f"checkpoint-{step}"
    tmp = output_dir / f"{TMP_PREFIX}{step}"
    opt_tensors, opt_meta = _split_optimizer_state(optimizer_state)
    if param_names is not None:
        opt_meta["param_names"] = list(param_names)
    _check_free_space(output_dir, final, [model_state, opt_tensors])
    if tmp.exists():
        shutil.rmtree(tmp)
    try:
        tmp.mkdir()
        _save_tensors(tmp / "model.safetensors", model_state)
        _save_tensors(tmp / "optimizer.safetensors", opt_tensors)
        rng_tensors, rng_json = _capture_rng()
        _save_tensors(tmp / "rng.safetensors", rng_tensors)
        state = {
            "format_version": FORMAT_VERSION,
            "step": step,
            "trainer": trainer_state,
            "optimizer": opt_meta,
            "scheduler": scheduler_state,
            "rng": rng_json,
        }
        _write_text(tmp / "state.json", json.dumps(state, indent=1))
        _write_manifest(tmp)
        fsync_path(tmp)
    except OSError as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        if is_no_space(exc):
            raise OutputDirError(
                f"no space left in output_dir {str(output_dir)!r} while saving checkpoint-{step} "
                f"(it needs about {_size(_tensor_bytes([model_state, opt_tensors]))}); nothing "
                f"of it was kept, {_newest_note(output_dir)}; free some space, then "
                f"{_next_run(output_dir)}"
            ) from None
        raise

    if final.exists():  # the same step saved again: the old copy leaves the namespace first
        _trash(final)
    tmp.rename(final)
    fsync_path(output_dir)

    if save_total_limit is not None:
        problem = check_sizes(final)
        if problem is not None:
            raise OutputDirError(f"{final} failed its check right after the save: {problem}")
        for stale in list_checkpoints(output_dir)[:-save_total_limit]:
            if stale != final:
                _trash(stale)
    _remove_trash(output_dir)
    return final


def load_checkpoint(path: Path) -> Checkpoint:
    """Read a checkpoint that `verify` passed."""
    try:
        state = json.loads((path / "state.json").read_text())
        if state.get("format_version") != FORMAT_VERSION:
            raise OutputDirError(
                f"{path}: checkpoint format {state.get('format_version')} is not supported"
            )
        opt_tensors = load_file(path / "optimizer.safetensors")
        return Checkpoint(
            path=path,
            step=state["step"],
            model_state=load_file(path / "model.safetensors"),
            optimizer_state=_join_optimizer_state(opt_tensors, state["optimizer"]),
            scheduler_state=state["scheduler"],
            trainer_state=state["trainer"],
            rng_tensors=load_file(path / "rng.safetensors"),
            rng_python=state["rng"]["python"],
            rng_numpy=state["rng"]["numpy"],
        )
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        # A checkpoint that verified but does not parse was written wrong: name it.
        raise OutputDirError(
            f"--resume: {path} does not parse ({type(exc).__name__}: {exc}); move it away "
            "to resume from the one before"
        ) from None


def restore_rng(ckpt: Checkpoint) -> None:
    torch.set_rng_state(ckpt.rng_tensors["torch_cpu"])
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            key = f"torch_cuda_{i}"
            if key in ckpt.rng_tensors:
                torch.cuda.set_rng_state(ckpt.rng_tensors[key], i)
    version, internal, gauss = ckpt.rng_python
    random.setstate((version, tuple(internal), gauss))
    name, keys, pos, has_gauss, cached = ckpt.rng_numpy
    np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))


# --------------------------------------------------------------------------------------


def _capture_rng() -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    tensors = {"torch_cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        for i in range(torch.cuda.device_count()):
            tensors[f"torch_cuda_{i}"] = torch.cuda.get_rng_state(i)
    version, internal, gauss = random.getstate()
    name, keys, pos, has_gauss, cached = np.random.get_state()
    return tensors, {
        "python": [version, list(internal), gauss],
        "numpy": [name, keys.tolist(), int(pos), int(has_gauss), float(cached)],
    }


def _split_optimizer_state(sd: dict[str, Any]) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Tensors go to safetensors; scalars and param groups to JSON."""
    tensors: dict[str, torch.Tensor] = {}
    scalars: dict[str, dict[str, Any]] = {}
    for index, per_param in sd["state"].items():
        for name, value in per_param.items():
            if isinstance(value, torch.Tensor):
                tensors[f"state.{index}.{name}"] = value
            else:
                scalars.setdefault(str(index), {})[name] = value
    groups = [
        {k: (list(v) if isinstance(v, tuple) else v) for k, v in g.items()}
        for g in sd["param_groups"]
    ]
    # Other top-level entries (the engine's `loss_scaler`) are JSON-able scalar dicts.
    extra = {k: _json_scalars(v) for k, v in sd.items() if k not in ("state", "param_groups")}
    return tensors, {"param_groups": groups, "scalars": scalars, "extra": extra}


def _join_optimizer_state(tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> dict[str, Any]:
    state: dict[int, dict[str, Any]] = {}
    for key, value in tensors.items():
        _, index, name = key.split(".", 2)
        state.setdefault(int(index), {})[name] = value
    for index, values in meta["scalars"].items():
        state.setdefault(int(index), {}).update(values)
    groups = saved_param_groups(meta["param_groups"])
    return {"state": state, "param_groups": groups, **meta.get("extra", {})}


def saved_param_groups(groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Optimizer param groups as read from JSON, with `betas` a tuple again."""
    return [{**g, "betas": tuple(g["betas"])} if "betas" in g else dict(g) for g in groups]


def _json_scalars(value: Any) -> Any:
    """A state entry as JSON: one-element tensors become numbers."""
    if isinstance(value, dict):
        return {k: _json_scalars(v) for k, v in value.items()}
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError("checkpoint: only scalar tensors may sit outside the optimizer state")
        return value.item()
    return value


def _trash(path: Path) -> None:
    """Take a checkpoint out of the `checkpoint-*` namespace (atomic); removed later."""
    path.rename(path.with_name(TRASH_PREFIX + path.name.removeprefix("checkpoint-")))
    fsync_path(path.parent)


def _remove_trash(output_dir: Path) -> None:
    for p in output_dir.iterdir():
        if p.name.startswith(TRASH_PREFIX):
            shutil.rmtree(p)


def _move_aside(path: Path) -> Path:
    """A damaged checkpoint leaves the namespace, kept for inspection."""
    aside = path.with_name(DAMAGED_PREFIX + path.name.removeprefix("checkpoint-"))
    n = 1
    while aside.exists():
        n += 1
        aside = path.with_name(f"{DAMAGED_PREFIX}{path.name.removeprefix('checkpoint-')}.{n}")
    path.rename(aside)
    fsync_path(path.parent)
    return aside


def _write_manifest(
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
    hashes = _hash_files([p for p in files if p.name not in known])
    hashes.update({tmp / name: sha for name, (_, sha) in known.items()})
    manifest = {
        "format": fmt,
        "files": {p.name: {"bytes": p.stat().st_size, "sha256": hashes[p]} for p in files},
    }
    if fmt == PLAIN:  # the plain format's manifest, as it always was
        del manifest["format"]
    _write_text(tmp / MANIFEST, json.dumps(manifest, indent=1))


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


def _hash_files(paths: list[Path]) -> dict[Path, str]:
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


def _tensor_bytes(groups: list[dict[str, torch.Tensor]]) -> int:
    return sum(t.numel() * t.element_size() for g in groups for t in g.values())


def space_needed_bytes(tensor_bytes: int) -> int:
    """The free space a checkpoint of ``tensor_bytes`` of tensors asks for: the check at
    start-up (on an estimate) and the check of every save (on the exact size) alike."""
    return tensor_bytes + _SPACE_MARGIN_BYTES


def _check_free_space(output_dir: Path, final: Path, groups: list[dict[str, torch.Tensor]]) -> None:
    needed = space_needed_bytes(_tensor_bytes(groups))
    free = shutil.disk_usage(output_dir).free
    if free < needed:
        raise OutputDirError(
            f"not enough space in output_dir {str(output_dir)!r} for {final.name}: it needs "
            f"about {_size(needed)}, {_size(free)} are free; nothing was written, "
            f"{_newest_note(output_dir)}; free some space, then {_next_run(output_dir)}"
        )


def _newest_note(output_dir: Path) -> str:
    newest = latest_checkpoint(output_dir)
    return f"{newest.name} is the newest checkpoint" if newest else "no checkpoint was saved yet"


def _next_run(output_dir: Path) -> str:
    """What continues after space was freed: a resume, or (nothing saved) the run again."""
    return "resume" if latest_checkpoint(output_dir) else "run it again"


def _size(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def _save_tensors(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    try:
        save_file({k: v.detach().to("cpu").contiguous() for k, v in tensors.items()}, str(path))
    except SafetensorError as exc:
        os_error = as_os_error(exc, path)
        if os_error is None:
            raise
        raise os_error from None
    fsync_path(path)


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


def is_no_space(exc: OSError) -> bool:
    return exc.errno in (errno.ENOSPC, errno.EDQUOT)


def _write_text(path: Path, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def fsync_path(path: Path) -> None:
    """Flush a file or a directory entry to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
