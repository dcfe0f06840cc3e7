"""Resumable training checkpoints, written atomically and read without unpickling.

Layout of `output_dir/checkpoint-<step>/`:
    model.safetensors      trainable parameters (all of them for full fine-tuning), fp32 master
    optimizer.safetensors  every tensor of the optimizer state, keyed `state.<index>.<name>`
    rng.safetensors        torch CPU and CUDA generator states
    state.json             step, data position, optimizer param groups and scalar state,
                           scheduler state, Python and NumPy RNG states

[Note: atomic save] Everything is written into `.tmp-checkpoint-<step>` next to the final
directory, each file is fsynced, and only then is the directory renamed into place. A
process killed mid-save leaves a `.tmp-*` directory that the next run removes, and every
`checkpoint-*` directory that exists is complete. Only after a rename succeeds are older
checkpoints pruned to `save_total_limit`.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file

FORMAT_VERSION = 1
CHECKPOINT_RE = re.compile(r"^checkpoint-(\d+)$")
TMP_PREFIX = ".tmp-checkpoint-"


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
    """Complete checkpoints, oldest first."""
    if not output_dir.is_dir():
        return []
    found = [
        (int(m.group(1)), p) for p in output_dir.iterdir() if (m := CHECKPOINT_RE.match(p.name))
    ]
    return [p for _, p in sorted(found)]


def latest_checkpoint(output_dir: Path) -> Path | None:
    checkpoints = list_checkpoints(output_dir)
    return checkpoints[-1] if checkpoints else None


def remove_partial_saves(output_dir: Path) -> list[Path]:
    """Delete `.tmp-checkpoint-*` left by a process that died while saving."""
    removed = []
    if output_dir.is_dir():
        for p in output_dir.iterdir():
            if p.name.startswith(TMP_PREFIX):
                shutil.rmtree(p, ignore_errors=True)
                removed.append(p)
    return removed


def save_checkpoint(
    output_dir: Path,
    step: int,
    *,
    model_state: dict[str, torch.Tensor],
    optimizer_state: dict[str, Any],
    scheduler_state: dict[str, Any],
    trainer_state: dict[str, Any],
    save_total_limit: int | None,
) -> Path:
    output_dir.mkdir(parents=True, exist_ok=True)
    final = output_dir / f"checkpoint-{step}"
    tmp = output_dir / f"{TMP_PREFIX}{step}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()

    _save_tensors(tmp / "model.safetensors", model_state)
    opt_tensors, opt_meta = _split_optimizer_state(optimizer_state)
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
    _fsync(tmp)

    if final.exists():  # the same step saved again after a resume: replace it
        old = output_dir / f"{TMP_PREFIX}{step}-old"
        final.rename(old)
        tmp.rename(final)
        shutil.rmtree(old)
    else:
        tmp.rename(final)
    _fsync(output_dir)

    if save_total_limit is not None:
        for stale in list_checkpoints(output_dir)[:-save_total_limit]:
            shutil.rmtree(stale)
    return final


def load_checkpoint(path: Path) -> Checkpoint:
    state = json.loads((path / "state.json").read_text())
    if state.get("format_version") != FORMAT_VERSION:
        raise ValueError(
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
    groups = []
    for g in meta["param_groups"]:
        g = dict(g)
        if "betas" in g:
            g["betas"] = tuple(g["betas"])
        groups.append(g)
    return {"state": state, "param_groups": groups, **meta.get("extra", {})}


def _json_scalars(value: Any) -> Any:
    """A state entry as JSON: one-element tensors become numbers."""
    if isinstance(value, dict):
        return {k: _json_scalars(v) for k, v in value.items()}
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError("checkpoint: only scalar tensors may sit outside the optimizer state")
        return value.item()
    return value


def _save_tensors(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    save_file({k: v.detach().to("cpu").contiguous() for k, v in tensors.items()}, str(path))
    _fsync(path)


def _write_text(path: Path, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def _fsync(path: Path) -> None:
    """Flush a file or a directory entry to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
