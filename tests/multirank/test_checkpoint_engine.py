"""Sharded checkpoints of the engine (``protrain.distributed.dcp_state``) saved on N ranks
and loaded on M, in either mode, at another chunk size (gloo on the CPU).

Loading copies values, so the state after a load equals the saved state bit for bit,
whatever the split on either side: every rank's masters and Adam moments are compared with
the whole state the saving run gathered. One process runs in the test itself; 2 and 3
ranks are spawned once per world size, each launch loading what the others saved before
saving its own.
"""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest
import torch
from tests.engine.models import batches, build, lora

import protrain
from protrain.distributed.dcp_flat import CheckpointMismatch, load_pieces, save_pieces
from protrain.distributed.dcp_state import pieces_to_save, plan_engine_load

from .ranks import run_ranks

# chunk sizes per world size: multiples of 64 x world, different on every side
CHUNK = {1: 32768, 2: 16384, 3: 16320}
STEPS, LR = 1, 1e-2


def _model(kind: str) -> torch.nn.Module:
    return lora(build("llama"), "llama") if kind == "lora" else build("llama")


def _wrap(kind: str, world: int, mode: str, group=None):
    model = _model(kind)
    ranks = {"distributed_mode": mode, "grad_reduce": "sum"} if world > 1 else {}
    model, opt, _ = protrain.wrap(
        model, n_persist=1, device="cpu", lr=LR, weight_decay=0.01,
        chunk_size_bytes=CHUNK[world], process_group=group, **ranks,
    )  # fmt: skip
    return model, opt


def _names(model) -> list[str]:
    return [n for n, p in model.named_parameters() if p.requires_grad]


def _train(model, opt, rank: int, world: int) -> None:
    data = batches("llama", STEPS * world)
    for step in range(STEPS):
        loss = model(**data[step * world + rank]).loss / world
        loss.backward()
        opt.clip_grad_norm_(1.0)
        opt.step()
        opt.zero_grad()


def _whole(model, opt) -> dict[str, torch.Tensor]:
    """Every trainable master and Adam tensor, whole (a collective with several ranks)."""
    state = protrain.state_dict(model, names=_names(model))
    out = {f"model/{k}": v.clone() for k, v in state.items()}
    for i, st in opt.state_dict()["state"].items():
        for k, v in st.items():
            out[f"optim/{i}/{k}"] = v.clone()
    return out


def _modes(world: int) -> tuple[str, ...]:
    return ("sharded", "replicated") if world > 1 else ("single",)


def _saves(root: Path, world: int, kind: str) -> list[Path]:
    return [root / f"{world}-{mode}-{kind}" for mode in _modes(world)]


def _save_and_load(root: Path, rank: int, world: int, load_from: list[int], group=None):
    """For each model kind and mode of this world size: load every checkpoint saved at the
    world sizes ``load_from`` into one wrapped model and compare with the whole state the
    saving run had; then train it and save it."""
    for kind in ("full", "lora"):
        for mode in _modes(world):
            model, opt = _wrap(kind, world, mode, group)
            for src in [p for n in load_from for p in _saves(root, n, kind)]:
                load = plan_engine_load(model, opt, _names(model), src)
                load_pieces(load.pieces, src, group)
                load.apply()
                want = pickle.loads((src / "whole.pkl").read_bytes())
                got = _whole(model, opt)
                assert set(got) == set(want), (src.name, sorted(set(got) ^ set(want))[:5])
                for k, v in want.items():
                    assert torch.equal(got[k], v), (src.name, world, mode, k)
            if not (root / f"{world}-{mode}-{kind}").exists():
                model, opt = _fresh(model, kind, world, mode, group)
                _train(model, opt, rank, world)
                out = root / f"{world}-{mode}-{kind}"
                save_pieces(pieces_to_save(model, opt, _names(model), rank, world), out, group)
                whole = _whole(model, opt)
                if rank == 0:
                    (out / "whole.pkl").write_bytes(pickle.dumps(whole))
            protrain.close(model)


def _fresh(model, kind, world, mode, group):
    protrain.close(model)
    return _wrap(kind, world, mode, group)


def _ranks(rank: int, world: int, root: str) -> None:
    """Three processes: the first two, as a group of their own, save; all three load that
    and save; the two load what the three saved."""
    import torch.distributed as dist

    root = Path(root)
    pair = dist.new_group([0, 1])
    if rank < 2:
        _save_and_load(root, rank, 2, [1], pair)
    dist.barrier()
    _save_and_load(root, rank, 3, [1, 2])
    dist.barrier()
    if rank < 2:
        _save_and_load(root, rank, 2, [3], pair)
    dist.barrier()


def test_save_on_n_ranks_load_on_m_in_any_mode_is_exact(tmp_path):
    _save_and_load(tmp_path, 0, 1, [])
    run_ranks(3, _ranks, str(tmp_path))
    _save_and_load(tmp_path, 0, 1, [2, 3])


def test_a_checkpoint_of_another_model_is_one_error_naming_the_file(tmp_path):
    model, opt = _wrap("full", 1, "single")
    _train(model, opt, 0, 1)
    save_pieces(pieces_to_save(model, opt, _names(model), 0, 1), tmp_path / "full")
    protrain.close(model)
    model, opt = _wrap("lora", 1, "single")
    load = plan_engine_load(model, opt, _names(model), tmp_path / "full")
    with pytest.raises(CheckpointMismatch, match=r"\.metadata holds no tensor 'model/base_model"):
        load_pieces(load.pieces, tmp_path / "full")
    protrain.close(model)
