"""`protrain convert-checkpoint SRC OUTPUT_DIR`: a checkpoint in the other format.

    protrain convert-checkpoint run/checkpoint-40 run-plain    # sharded -> plain
    protrain convert-checkpoint run/checkpoint-40 run-sharded  # plain -> sharded

Either way `OUTPUT_DIR/checkpoint-<step>` holds the same step, weights, optimizer and
scheduler state, data position and (rank 0's) RNG states, written atomically and verified
as a save is; `protrain train --resume` with `output_dir: OUTPUT_DIR` continues from it.
`OUTPUT_DIR` is held with the run lock while the conversion writes (`run_lock.py`): a
run training there, which saves and prunes checkpoints, refuses it and is refused by it.
Both formats already resume at any world size, so a conversion is for the reader of the
files: the plain format is three safetensors files that any tool reads whole (one process
holds the whole state while converting), the sharded format lets each rank read only its
own elements. CUDA generator states are not carried over (the conversion runs on the CPU).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from protrain.distributed.dcp_flat import FlatPiece, load_pieces, saved_keys
from protrain.distributed.dcp_state import model_key, optim_key
from protrain.optim.state_format import decode_state
from protrain.train.checkpoint import plain as ckpt
from protrain.train.checkpoint import sharded
from protrain.train.checkpoint.directory import CHECKPOINT_RE, SHARDED, checkpoint_format, verify
from protrain.train.errors import OutputDirError
from protrain.train.log import logger
from protrain.train.ranks import Ranks
from protrain.train.run_lock import RunLock


def convert_checkpoint(src: Path, output_dir: Path) -> Path:
    """Write `src` (a `checkpoint-<step>` directory) into `output_dir` in the other
    format; the new checkpoint's path."""
    src, output_dir = Path(src), Path(output_dir)
    if not src.exists():
        raise OutputDirError(f"convert-checkpoint: {str(src)!r} does not exist")
    if not CHECKPOINT_RE.match(src.name) or not src.is_dir():
        raise OutputDirError(f"convert-checkpoint: {str(src)!r} is not a checkpoint-<step> folder")
    problem = verify(src)
    if problem is not None:
        raise OutputDirError(f"convert-checkpoint: {src} is damaged ({problem}); nothing written")
    if output_dir.resolve().is_relative_to(src.resolve()):  # rotation would delete it with src
        raise OutputDirError(
            f"convert-checkpoint: the output {str(output_dir)!r} is inside the checkpoint "
            f"{str(src)!r} it converts; choose a directory outside it (the run's output_dir, "
            "or a new one)"
        )
    try:
        lock = RunLock(output_dir).acquire()
    except OutputDirError as exc:
        raise OutputDirError(f"convert-checkpoint: {exc}") from None
    try:
        dst = output_dir / src.name
        if dst.exists():
            raise OutputDirError(
                f"convert-checkpoint: {dst} already exists; choose another output directory"
            )
        if checkpoint_format(src) == SHARDED:
            return _to_plain(src, output_dir)
        return _to_sharded(src, output_dir)
    finally:
        lock.release()


def _to_plain(src: Path, output_dir: Path) -> Path:
    state = sharded.read_state(src)
    names = state["optimizer"]["param_names"]
    shapes = {k: tuple(v) for k, v in state["parameters"].items()}
    saved = saved_keys(src)
    pieces, model_state, moments = sharded.whole_pieces(shapes, saved)
    rng = {k.removeprefix("rng/0/"): k for k in saved if k.startswith("rng/0/")}
    rng_tensors = {name: torch.empty(saved[key], dtype=torch.uint8) for name, key in rng.items()}
    pieces += [FlatPiece(rng[name], t, 0, t.numel()) for name, t in rng_tensors.items()]
    load_pieces(pieces, src)
    meta = state["optimizer"]
    optimizer_state: dict[str, Any] = {
        "state": {i: moments[name] for i, name in enumerate(names) if name in moments},
        "param_groups": meta["param_groups"],
    }
    if "loss_scaler" in meta:
        optimizer_state["loss_scaler"] = meta["loss_scaler"]
    if "optimizer" in meta:
        optimizer_state["optimizer"] = meta["optimizer"]
    fmt = meta.get("optimizer_state", "fp32")
    optimizer_state["optimizer_state"] = fmt
    if fmt != "fp32":  # the sharded format holds compact moments decoded to fp32
        optimizer_state["moments_gathered"] = True
    # save_checkpoint writes this process's RNG states: make them the saved rank 0's
    torch.set_rng_state(rng_tensors["torch_cpu"])
    sharded.set_host_rng(state["rng"][0])
    path = ckpt.save_checkpoint(
        output_dir,
        state["step"],
        model_state=model_state,
        optimizer_state=optimizer_state,
        scheduler_state=state["scheduler"],
        trainer_state=state["trainer"],
        save_total_limit=None,
        param_names=names,
    )
    logger.info("converted %s (sharded, %d ranks) to %s (plain)", src, state["world_size"], path)
    return path


def _to_sharded(src: Path, output_dir: Path) -> Path:
    plain = ckpt.load_checkpoint(src)
    meta = json.loads((src / "state.json").read_text())["optimizer"]
    names = meta.get("param_names")
    if names is None:
        raise OutputDirError(
            f"convert-checkpoint: {src / 'state.json'} does not name the optimizer's parameters "
            "(a checkpoint written before they were recorded); resume it and save once, then "
            "convert the new checkpoint"
        )
    pieces = []
    for name, t in plain.model_state.items():
        flat = t.detach().to(torch.float32).reshape(-1).contiguous()
        pieces.append(FlatPiece(model_key(name), flat, 0, flat.numel()))
    fmt = plain.optimizer_state.get("optimizer_state", "fp32")
    for index, st in plain.optimizer_state["state"].items():
        name = names[int(index)]
        if fmt != "fp32" and st["exp_avg"].dtype != torch.float32:  # compact: decoded
            m, v = decode_state(fmt, st)
            st = {"step": st["step"], "exp_avg": m, "exp_avg_sq": v}
        _check_fp32_adam(src, st)
        for k, v in st.items():
            flat = torch.as_tensor(v, dtype=torch.float32).reshape(-1).contiguous()
            pieces.append(FlatPiece(optim_key(name, k), flat, 0, flat.numel()))
    groups = [
        {k: (list(v) if isinstance(v, tuple) else v) for k, v in g.items()}
        for g in plain.optimizer_state["param_groups"]
    ]
    optimizer_meta: dict[str, Any] = {"param_groups": groups, "param_names": names}
    if "loss_scaler" in plain.optimizer_state:
        optimizer_meta["loss_scaler"] = plain.optimizer_state["loss_scaler"]
    optimizer_meta["optimizer_state"] = fmt
    if "optimizer" in plain.optimizer_state:
        optimizer_meta["optimizer"] = plain.optimizer_state["optimizer"]
    state = {
        "mode": "single",
        "parameters": {k: list(v.shape) for k, v in plain.model_state.items()},
        "trainer": plain.trainer_state,
        "optimizer": optimizer_meta,
        "scheduler": plain.scheduler_state,
    }
    ckpt.restore_rng(plain)  # write_sharded writes this process's RNG states
    path = sharded.write_sharded(output_dir, plain.step, pieces, state, Ranks(), None)
    logger.info("converted %s (plain) to %s (sharded)", src, path)
    return path


_FP32_ADAM_KEYS = {"step", "exp_avg", "exp_avg_sq"}


def _check_fp32_adam(src: Path, st: dict[str, Any]) -> None:
    """The sharded format holds torch's fp32 Adam moments of each parameter's shape (compact
    host moments decoded to them): bitsandbytes' 8-bit state is refused, not written as
    garbage floats."""
    if set(st) - _FP32_ADAM_KEYS:
        raise OutputDirError(
            f"convert-checkpoint: {src} holds bitsandbytes' 8-bit optimizer state "
            f"({', '.join(sorted(set(st) - _FP32_ADAM_KEYS))}), which the sharded format does "
            "not carry (it holds fp32 Adam moments); resume it in the plain format as it is"
        )
