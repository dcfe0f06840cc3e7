"""Resumable training checkpoints: atomic, verified, read without unpickling.

Layout of `output_dir/checkpoint-<step>/`, written by one process (the plain format):
    model.safetensors      trainable parameters (all of them for full fine-tuning), fp32 master
    optimizer.safetensors  every tensor of the optimizer state, keyed `state.<index>.<name>`
    rng.safetensors        torch CPU and CUDA generator states
    state.json             step, data position, optimizer param groups and scalar state,
                           scheduler state, Python and NumPy RNG states
    manifest.json          every other file's size and sha256

Written by several ranks of the chunked engine, the sharded format (`sharded.py`):
`.metadata` and one `__<rank>_0.distcp` per rank (torch.distributed.checkpoint) in place of
the three safetensors files, `state.json` and `manifest.json` as above (the manifest says
`"format": "sharded"`). Both formats load at any world size and mode.

Both are written, verified, pruned and resumed through `directory.py`.
"""

from __future__ import annotations

import json
import random
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

import protrain.train.checkpoint.directory as directory
from protrain.train.checkpoint.directory import (
    TMP_PREFIX,
    list_checkpoints,
    newest_note,
    next_run,
    space_needed_bytes,
)
from protrain.train.checkpoint.disk import (
    as_os_error,
    format_size,
    fsync_path,
    is_no_space,
    write_text,
)
from protrain.train.errors import OutputDirError
from protrain.train.nonfinite import assert_finite

FORMAT_VERSION = 1


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
        rng_tensors, rng_json = capture_rng()
        _save_tensors(tmp / "rng.safetensors", rng_tensors)
        state = {
            "format_version": FORMAT_VERSION,
            "step": step,
            "trainer": trainer_state,
            "optimizer": opt_meta,
            "scheduler": scheduler_state,
            "rng": rng_json,
        }
        write_text(tmp / "state.json", json.dumps(state, indent=1))
        directory.write_manifest(tmp)
        fsync_path(tmp)
    except OSError as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        if is_no_space(exc):
            raise OutputDirError(
                f"no space left in output_dir {str(output_dir)!r} while saving checkpoint-{step} "
                f"(it needs about {format_size(_tensor_bytes([model_state, opt_tensors]))}); nothing "
                f"of it was kept, {newest_note(output_dir)}; free some space, then "
                f"{next_run(output_dir)}"
            ) from None
        raise

    if final.exists():  # the same step saved again: the old copy leaves the namespace first
        directory.trash(final)
    tmp.rename(final)
    fsync_path(output_dir)

    if save_total_limit is not None:
        problem = directory.check_sizes(final)
        if problem is not None:
            raise OutputDirError(f"{final} failed its check right after the save: {problem}")
        for stale in list_checkpoints(output_dir)[:-save_total_limit]:
            if stale != final:
                directory.trash(stale)
    directory.remove_trash(output_dir)
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


def capture_rng() -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
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
    extra = {k: json_scalars(v) for k, v in sd.items() if k not in ("state", "param_groups")}
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


def json_scalars(value: Any) -> Any:
    """A state entry as JSON: one-element tensors become numbers."""
    if isinstance(value, dict):
        return {k: json_scalars(v) for k, v in value.items()}
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError("checkpoint: only scalar tensors may sit outside the optimizer state")
        return value.item()
    return value


def _tensor_bytes(groups: list[dict[str, torch.Tensor]]) -> int:
    return sum(t.numel() * t.element_size() for g in groups for t in g.values())


def _check_free_space(output_dir: Path, final: Path, groups: list[dict[str, torch.Tensor]]) -> None:
    needed = space_needed_bytes(_tensor_bytes(groups))
    free = shutil.disk_usage(output_dir).free
    if free < needed:
        raise OutputDirError(
            f"not enough space in output_dir {str(output_dir)!r} for {final.name}: it needs "
            f"about {format_size(needed)}, {format_size(free)} are free; nothing was written, "
            f"{newest_note(output_dir)}; free some space, then {next_run(output_dir)}"
        )


def _save_tensors(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    try:
        save_file({k: v.detach().to("cpu").contiguous() for k, v in tensors.items()}, str(path))
    except SafetensorError as exc:
        os_error = as_os_error(exc, path)
        if os_error is None:
            raise
        raise os_error from None
    fsync_path(path)
