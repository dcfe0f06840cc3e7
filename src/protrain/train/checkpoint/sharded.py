"""Sharded checkpoints: every rank of the chunked engine, or of the FSDP2 engine, writes its
own part, in parallel, and any number of ranks in any mode or engine (or one process)
resumes from it.

Layout of `checkpoint-<step>/` (see `plain.py` for the plain format beside it):
    .metadata, __<rank>_0.distcp   torch.distributed.checkpoint: the fp32 masters and Adam
                                   state of the trainable parameters, named by parameter
                                   (`protrain.distributed.dcp_state`), and each rank's torch
                                   generator states (`rng/<rank>/<name>`)
    state.json                     step, data position, optimizer param groups and loss
                                   scale, scheduler state, each rank's Python and NumPy RNG
                                   states, every parameter's shape, the world size and mode
    manifest.json                  every other file's size and sha256; `"format": "sharded"`

[Note: atomic across ranks]
Rank 0 makes `.tmp-checkpoint-<step>`; after a barrier every rank writes its `.distcp`
through DCP (whose coordinator, rank 0, writes `.metadata` once all ranks' data is
written) and hashes its own file; rank 0 gathers the hashes, writes `state.json` and the
manifest, and renames the directory into place, then prunes (complete checkpoints only,
[Note: pruning] in `directory.py`); a last barrier makes the checkpoint count for every
rank. A rank killed at any moment leaves either no `checkpoint-<step>` (the `.tmp-*` is
removed by the next `--resume`, or completed when its manifest verifies) or a complete one:
the previous checkpoint is untouched until the new one is in place. A rank that dies stops
the others in the save's collectives, and torchrun ends the job. A failure every rank sees
(the disk full, non-finite weights) is raised on every rank with the same message.

[Note: resuming at another world size]
A sharded checkpoint loads into the engine at any world size, mode or chunk size (each rank
reads the elements it holds: DCP reads the overlaps of the saved pieces) and, whole, into
one process of plain PyTorch. Rank r takes the saved RNG states of rank r mod N: with the
same world size the run continues exactly; with another, the generators of ranks differ
from an uninterrupted run only where the training draws random numbers (dropout).
"""

from __future__ import annotations

import errno
import json
import random
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from protrain.distributed.agree import agreed
from protrain.distributed.dcp_flat import (
    CheckpointMismatch,
    FlatPiece,
    load_pieces,
    save_pieces,
    saved_keys,
)
from protrain.distributed.dcp_state import (
    STEP,
    model_key,
    optim_key,
    pieces_to_save,
    plan_engine_load,
)
from protrain.distributed.fsdp2.checkpoint import fsdp2_pieces_to_save, plan_fsdp2_load
from protrain.optim.adamw_8bit import optimizer_choice, saved_choice
from protrain.train.checkpoint import directory
from protrain.train.checkpoint.directory import (
    MANIFEST,
    SHARDED,
    TMP_PREFIX,
    check_sizes,
    list_checkpoints,
    newest_note,
    space_needed_bytes,
)
from protrain.train.checkpoint.disk import NO_SPACE, format_size, fsync_path, hash_files, write_text
from protrain.train.checkpoint.plain import capture_rng, json_scalars, saved_param_groups
from protrain.train.errors import OutputDirError
from protrain.train.nonfinite import NonFiniteError, first_nonfinite
from protrain.train.ranks import Ranks

FORMAT_VERSION = 1
# Called with a file's name just before this rank writes it (tests kill a rank there).
before_write: Callable[[str], None] | None = None


def engine_of(trainable) -> Any:
    """The chunked engine behind a trainable, or None (plain PyTorch, FSDP2)."""
    return getattr(trainable.model, "_protrain_engine", None)


def is_fsdp2(trainable) -> bool:
    """The FSDP2 engine (`FSDP2Trainable.shards_checkpoints`), whose parameters are DTensors."""
    return bool(getattr(trainable, "shards_checkpoints", False))


def writes_sharded(trainable, ranks: Ranks) -> bool:
    """Several ranks of the chunked engine or of the FSDP2 engine save sharded; one
    process the plain format."""
    return ranks.several and (engine_of(trainable) is not None or is_fsdp2(trainable))


def _about_to_write(name: str) -> None:
    if before_write is not None:
        before_write(name)


def save_sharded_checkpoint(
    output_dir: Path,
    step: int,
    *,
    trainable,
    ranks: Ranks,
    scheduler_state: dict[str, Any],
    trainer_state: dict[str, Any],
    save_total_limit: int | None,
) -> Path:
    """Write checkpoint-`step` from every rank (a collective: every rank calls it); see
    [Note: atomic across ranks]."""
    optimizer = trainable.optimizer
    engine = engine_of(trainable)
    if engine is not None:
        pieces = pieces_to_save(
            trainable.model, optimizer, trainable.names, ranks.rank, ranks.world_size
        )
        mode = "sharded" if engine.manager.sharded else "replicated"
    else:  # the FSDP2 engine: each rank its dim-0 shards
        pieces = fsdp2_pieces_to_save(
            trainable.model, optimizer, trainable.names, ranks.rank, ranks.world_size
        )
        mode = "fsdp2"
    state = {
        "mode": mode,
        "parameters": _shapes(trainable),
        "trainer": trainer_state,
        "optimizer": _optimizer_meta(optimizer, trainable.model),
        "scheduler": scheduler_state,
    }
    return write_sharded(output_dir, step, pieces, state, ranks, save_total_limit)


def write_sharded(
    output_dir: Path,
    step: int,
    pieces: list[FlatPiece],
    state: dict[str, Any],
    ranks: Ranks,
    save_total_limit: int | None,
) -> Path:
    """Write checkpoint-`step` of this rank's `pieces` (`model/...`, `optim/...`) and, from
    rank 0, `state` (its keys beside `step`, `world_size`, `rng`, which are added here),
    with this process's RNG states; see [Note: atomic across ranks]. A collective."""
    group = ranks.ctx.group if ranks.several else None
    final = output_dir / f"checkpoint-{step}"
    tmp = output_dir / f"{TMP_PREFIX}{step}"
    model_pieces = {p.key: p.tensor for p in pieces if p.key.startswith("model/")}
    bad_name = _first_of_all(ranks, first_nonfinite(model_pieces))
    if bad_name is not None:
        raise NonFiniteError(
            f"checkpoint-{step} not written: weight {bad_name.removeprefix('model/')!r} is not "
            "finite (NaN or inf); the checkpoints already written are kept. Try a lower "
            "learning_rate, or set max_grad_norm"
        )
    local_bytes = sum(p.tensor.numel() * p.tensor.element_size() for p in pieces)
    total_bytes = int(ranks.sum(local_bytes)[0])

    problem = None
    if ranks.is_main:
        problem = _prepare(output_dir, final, tmp, total_bytes)
    _raise_on_every_rank(ranks, problem)

    rng_tensors, rng_json = capture_rng()
    pieces = pieces + [
        FlatPiece(f"rng/{ranks.rank}/{k}", v.reshape(-1).contiguous(), 0, v.numel())
        for k, v in rng_tensors.items()
    ]
    try:
        save_pieces(pieces, tmp, group, before_write=_about_to_write)
        own = _hash_own_files(tmp, ranks.rank)
        failed = None
    except OSError as exc:
        own, failed = {}, exc
    every = _gather(ranks, (own, rng_json, _errno_of(failed)))
    codes = [code for _, _, code in every if code is not None]
    problem = None
    if ranks.is_main:
        if codes:
            shutil.rmtree(tmp, ignore_errors=True)
            problem = _write_failed(output_dir, step, codes[0], total_bytes)
        else:
            known = {name: info for files, _, _ in every for name, info in files.items()}
            state = {
                "format_version": FORMAT_VERSION,
                "step": step,
                "world_size": ranks.world_size,
                **state,
                "rng": [r for _, r, _ in every],
            }
            problem = _publish(output_dir, step, tmp, final, state, known, save_total_limit)
    _raise_on_every_rank(ranks, problem)
    ranks.barrier()  # a checkpoint counts once written, for every rank
    return final


@dataclass
class Resumed:
    step: int
    trainer_state: dict[str, Any]
    scheduler_state: dict[str, Any]


def read_state(path: Path) -> dict[str, Any]:
    """`state.json` of a sharded checkpoint that `verify` passed."""
    try:
        state = json.loads((path / "state.json").read_text())
    except (OSError, ValueError) as exc:
        raise OutputDirError(f"--resume: {path / 'state.json'} does not parse ({exc})") from None
    if state.get("format_version") != FORMAT_VERSION:
        raise OutputDirError(
            f"--resume: {path / 'state.json'}: sharded checkpoint format "
            f"{state.get('format_version')} is not supported (this version reads "
            f"{FORMAT_VERSION})"
        )
    return state


def load_sharded_checkpoint(path: Path, trainable, ranks: Ranks) -> Resumed:
    """Load a sharded checkpoint into `trainable` on every rank (a collective with several
    ranks); see [Note: resuming at another world size]."""
    state = read_state(path)
    _check_parameters(path, state, trainable)
    group = ranks.ctx.group if ranks.several else None
    try:
        _check_markers(trainable.optimizer, state["optimizer"], path)
        if engine_of(trainable) is not None or is_fsdp2(trainable):
            if engine_of(trainable) is not None:
                load = plan_engine_load(trainable.model, trainable.optimizer, trainable.names, path)
            else:
                load = plan_fsdp2_load(
                    trainable.model,
                    trainable.optimizer,
                    trainable.names,
                    path,
                    ranks.rank,
                    ranks.world_size,
                )
            load_pieces(load.pieces, path, group)
            load.apply()
            _load_optimizer_meta(trainable.optimizer, state["optimizer"], path)
        else:
            _load_whole(path, trainable, state)
        _restore_rng(path, state, ranks, group)
    except CheckpointMismatch as exc:
        raise OutputDirError(f"--resume: {exc}") from None
    return Resumed(
        step=state["step"], trainer_state=state["trainer"], scheduler_state=state["scheduler"]
    )


# --------------------------------------------------------------------------------------


def _gather(ranks: Ranks, obj: Any) -> list[Any]:
    """Every rank's ``obj``, in rank order, on every rank."""
    if not ranks.several:
        return [obj]
    every = [None] * ranks.world_size
    dist.all_gather_object(every, obj, group=ranks.ctx.group)
    return every


def _first_of_all(ranks: Ranks, name: str | None) -> str | None:
    """The first rank's non-None ``name`` (every rank learns it)."""
    return next((n for n in _gather(ranks, name) if n is not None), None)


def _raise_on_every_rank(ranks: Ranks, problem: str | None) -> None:
    """Rank 0's verdict, raised alike everywhere: no rank waits in a collective the others
    left."""
    problem = ranks.from_main(problem)
    if problem is not None:
        raise agreed(ranks.ctx, OutputDirError(problem))


def _prepare(output_dir: Path, final: Path, tmp: Path, total_bytes: int) -> str | None:
    """Rank 0: room on the disk, a fresh `.tmp-*`; what is wrong, or None."""
    try:
        output_dir.mkdir(parents=True, exist_ok=True)
        needed = space_needed_bytes(total_bytes)
        free = shutil.disk_usage(output_dir).free
        if free < needed:
            return (
                f"not enough space in output_dir {str(output_dir)!r} for {final.name}: it "
                f"needs about {format_size(needed)}, {format_size(free)} are free; nothing was "
                f"written, {newest_note(output_dir)}; free some space, then resume"
            )
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir()
    except OSError as exc:
        return f"output_dir {str(output_dir)!r}: {final.name} cannot be written ({exc})"
    return None


def _errno_of(exc: OSError | None) -> int | None:
    if exc is None:
        return None
    return exc.errno if exc.errno is not None else errno.EIO


def _write_failed(output_dir: Path, step: int, code: int, total_bytes: int) -> str:
    if code in NO_SPACE:
        return (
            f"no space left in output_dir {str(output_dir)!r} while saving checkpoint-{step} "
            f"(it needs about {format_size(total_bytes)}); nothing of it was kept, "
            f"{newest_note(output_dir)}; free some space, then resume"
        )
    return (
        f"checkpoint-{step} could not be written to output_dir {str(output_dir)!r} "
        f"({errno.errorcode.get(code, code)}); nothing of it was kept, "
        f"{newest_note(output_dir)}"
    )


def _hash_own_files(tmp: Path, rank: int) -> dict[str, tuple[int, str]]:
    """This rank's data files, hashed here (every rank reads back its own, in parallel)."""
    files = sorted(tmp.glob(f"__{rank}_*.distcp"))
    hashes = hash_files(files)
    return {p.name: (p.stat().st_size, hashes[p]) for p in files}


def _publish(
    output_dir: Path,
    step: int,
    tmp: Path,
    final: Path,
    state: dict[str, Any],
    known: dict[str, tuple[int, str]],
    save_total_limit: int | None,
) -> str | None:
    """Rank 0, once every rank's part is written: state.json, the manifest, the rename,
    pruning. What went wrong, or None."""
    try:
        _about_to_write("state.json")
        write_text(tmp / "state.json", json.dumps(state, indent=1))
        _about_to_write(MANIFEST)
        directory.write_manifest(tmp, known, SHARDED)
        fsync_path(tmp)
        problem = check_sizes(tmp)
        if problem is not None:
            shutil.rmtree(tmp, ignore_errors=True)
            return f"checkpoint-{step} failed its check before it was put in place: {problem}"
        _about_to_write(final.name)
        if final.exists():  # the same step saved again: the old copy leaves the namespace first
            directory.trash(final)
        tmp.rename(final)
        fsync_path(output_dir)
        if save_total_limit is not None:
            for stale in list_checkpoints(output_dir)[:-save_total_limit]:
                if stale != final:
                    directory.trash(stale)
        directory.remove_trash(output_dir)
    except OSError as exc:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
        if exc.errno in NO_SPACE:
            return (
                f"no space left in output_dir {str(output_dir)!r} while saving "
                f"checkpoint-{step}; nothing of it was kept, {newest_note(output_dir)}; "
                "free some space, then resume"
            )
        raise
    return None


def _shapes(trainable) -> dict[str, list[int]]:
    params = dict(trainable.model.named_parameters())
    return {name: list(params[name].shape) for name in trainable.names}


def _check_parameters(path: Path, state: dict[str, Any], trainable) -> None:
    """The checkpoint is of this model: the same trainable names and shapes."""
    saved = {k: tuple(v) for k, v in state.get("parameters", {}).items()}
    now = {k: tuple(v) for k, v in _shapes(trainable).items()}
    if saved == now:
        return
    missing = sorted(set(now) - set(saved))
    unexpected = sorted(set(saved) - set(now))
    reshaped = sorted(k for k in set(now) & set(saved) if now[k] != saved[k])
    parts = []
    if missing:
        parts.append(f"it lacks {missing[:3]}{' ...' if len(missing) > 3 else ''}")
    if unexpected:
        parts.append(f"it has {unexpected[:3]}{' ...' if len(unexpected) > 3 else ''}")
    for k in reshaped[:3]:
        parts.append(f"{k} is {list(saved[k])} there, {list(now[k])} here")
    raise OutputDirError(
        f"--resume: {path / 'state.json'} is a checkpoint of another model or adapter "
        f"({'; '.join(parts)}); resume it with the config that wrote it, or start a new "
        "output_dir"
    )


def optimizer_param_names(optimizer, model) -> list[str] | None:
    """The parameter name of each index of the optimizer's state dict (its param groups'
    order): what maps the plain format's `state.<index>` to the sharded format's names.
    None where the optimizer holds tensors that are not the model's parameters."""
    names = {id(p): n for n, p in model.named_parameters()}
    ordered = [names.get(id(p)) for g in optimizer.param_groups for p in g["params"]]
    return None if None in ordered else ordered


def _optimizer_meta(optimizer, model) -> dict[str, Any]:
    """Param groups (hyperparameters; `params` as indices, as in torch's state dict), the
    name of each index, and the engine's loss-scaler state: JSON."""
    groups, start = [], 0
    for g in optimizer.param_groups:
        d = {k: (list(v) if isinstance(v, tuple) else v) for k, v in g.items() if k != "params"}
        d["params"] = list(range(start, start + len(g["params"])))
        start += len(g["params"])
        groups.append(d)
    meta: dict[str, Any] = {
        "param_groups": groups,
        "param_names": optimizer_param_names(optimizer, model),
        **_optimizer_markers(optimizer),
    }
    scaler = getattr(optimizer, "scaler", None)
    if scaler is not None and scaler.enabled:
        meta["loss_scaler"] = json_scalars(scaler.state_dict())
    return meta


def _optimizer_markers(optimizer) -> dict[str, str]:
    """The optimizer choice and the host moments' format, as the plain format names them."""
    return {
        "optimizer": optimizer_choice(optimizer),
        "optimizer_state": getattr(optimizer, "state_format", "fp32"),
    }


def _check_markers(optimizer, meta: dict[str, Any], path: Path) -> None:
    """Refuse a checkpoint of another optimizer choice or host-moment format before
    anything loads (older checkpoints carry no markers: fp32, choice unchecked)."""
    have = _optimizer_markers(optimizer)
    for key, saved in (("optimizer", saved_choice(meta.get("optimizer"))),
                       ("optimizer_state", meta.get("optimizer_state", "fp32"))):  # fmt: skip
        if saved is not None and saved != have[key]:
            raise CheckpointMismatch(
                f"{path / 'state.json'}: its optimizer state was saved with {key}={saved!r}, "
                f"this run's is {have[key]!r}; resume with the {key} it was saved with"
            )


def _check_groups(optimizer, saved: list[dict], path: Path) -> None:
    sizes = [len(g["params"]) for g in saved]
    have = [len(g["params"]) for g in optimizer.param_groups]
    if sizes != have:
        raise OutputDirError(
            f"--resume: {path / 'state.json'}: its optimizer has parameter groups of sizes "
            f"{sizes}, this run's {have}"
        )


def _load_optimizer_meta(optimizer, meta: dict[str, Any], path: Path) -> None:
    _check_groups(optimizer, meta["param_groups"], path)
    for g, sg in zip(optimizer.param_groups, meta["param_groups"]):
        g.update({k: (tuple(v) if k == "betas" else v) for k, v in sg.items() if k != "params"})
    if "loss_scaler" in meta and optimizer.scaler.enabled:
        optimizer.scaler.load_state_dict(meta["loss_scaler"])


def whole_pieces(shapes: dict[str, tuple[int, ...]], saved: dict[str, Any]):
    """``(pieces, model_state, moments)``: fp32 buffers to read each named parameter and
    the optimizer state ``saved`` holds for it whole (``load_pieces`` fills them), as
    ``{name: tensor}`` and ``{name: {state: tensor}}`` views of the parameters' shapes."""
    pieces, model_state, moments = [], {}, {}
    for name, shape in shapes.items():
        n = int(np.prod(shape, dtype=np.int64))
        t = torch.empty(n, dtype=torch.float32)
        pieces.append(FlatPiece(model_key(name), t, 0, n))
        model_state[name] = t.view(shape)
        prefix = optim_key(name, "")
        for k in sorted(k[len(prefix) :] for k in saved if k.startswith(prefix)):
            size = 1 if k == STEP else n
            v = torch.empty(size, dtype=torch.float32)
            pieces.append(FlatPiece(optim_key(name, k), v, 0, size))
            moments.setdefault(name, {})[k] = v.view(()) if k == STEP else v.view(shape)
    return pieces, model_state, moments


def _load_whole(path: Path, trainable, state: dict[str, Any]) -> None:
    """One process of plain PyTorch: every tensor whole, then the trainable's own loads
    (the same calls as for the plain format)."""
    params = dict(trainable.model.named_parameters())
    shapes = {name: tuple(params[name].shape) for name in trainable.names}
    pieces, model_state, moments = whole_pieces(shapes, saved_keys(path))
    load_pieces(pieces, path, None)
    trainable.load_model_state(model_state)
    meta = state["optimizer"]
    _check_groups(trainable.optimizer, meta["param_groups"], path)
    index = {id(p): i for i, p in enumerate(p for g in trainable.optimizer.param_groups
                                            for p in g["params"])}  # fmt: skip
    opt_state = {
        index[id(params[name])]: st for name, st in moments.items() if id(params[name]) in index
    }
    sd = {"state": opt_state, "param_groups": saved_param_groups(meta["param_groups"])}
    if "loss_scaler" in meta and getattr(trainable.optimizer, "scaler", None) is not None:
        sd["loss_scaler"] = meta["loss_scaler"]
    trainable.optimizer.load_state_dict(sd)


def _restore_rng(path: Path, state: dict[str, Any], ranks: Ranks, group) -> None:
    saved_world = int(state["world_size"])
    src = ranks.rank % saved_world
    saved = saved_keys(path)
    prefix = f"rng/{src}/"
    tensors = {}
    pieces = []
    for key in sorted(k for k in saved if k.startswith(prefix)):
        t = torch.empty(saved[key], dtype=torch.uint8)
        pieces.append(FlatPiece(key, t, 0, saved[key]))
        tensors[key.removeprefix(prefix)] = t
    # A collective with several ranks, each reading its source rank's states.
    load_pieces(pieces, path, group)
    if "torch_cpu" not in tensors:
        raise CheckpointMismatch(f"{path / '.metadata'} holds no torch_cpu RNG state of rank {src}")
    torch.set_rng_state(tensors["torch_cpu"])
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            if f"torch_cuda_{i}" in tensors:
                torch.cuda.set_rng_state(tensors[f"torch_cuda_{i}"], i)
    set_host_rng(state["rng"][src])


def set_host_rng(saved: dict[str, Any]) -> None:
    """Python's and NumPy's generators from a rank's saved JSON states."""
    version, internal, gauss = saved["python"]
    random.setstate((version, tuple(internal), gauss))
    name, keys, pos, has_gauss, cached = saved["numpy"]
    np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
