"""Several ranks with every chunk offloaded, the host AdamW by the one-pass kernel and by
torch's fallback: each equals plain PyTorch on one process (gloo on the CPU, fp32: to 1e-6,
as tests/multirank/test_engine_exact.py, whose reference and schedule this reuses), and the
two paths agree with each other. Sharded: each rank's pass steps its own shard and writes
its own shard of the host copy, which the next gather all-gathers; replicated: every rank
steps the whole chunk."""

from __future__ import annotations

import os

import pytest
import torch
from tests.engine.models import batches

import protrain
from protrain.optim import host_adam_ext

from .ranks import run_ranks
from .test_engine_exact import ACCUM, LR, MAX_NORM, STEPS, WD, _eps, _model, _plain


def _rank_train(rank, world, mode, path, out_dir):
    if path == "torch":
        os.environ[host_adam_ext.ENV_VAR] = "torch"
    model = _model(adapter=False)
    data = batches("llama", STEPS * ACCUM * world)
    model, opt, layout = protrain.wrap(
        model,
        device="cpu",
        n_persist=0,
        lr=LR,
        weight_decay=WD,
        eps=_eps(world),
        chunk_size_bytes=16384,
        distributed_mode=mode,
        grad_reduce="sum",
    )
    assert layout.n_chunks > 2, layout
    losses = []
    for step in range(STEPS):
        for mb in range(ACCUM):
            i = step * ACCUM * world + mb * world + rank
            loss = model(**data[i]).loss / (ACCUM * world)
            loss.backward()
            losses.append((i, loss.item()))
        opt.clip_grad_norm_(MAX_NORM)
        opt.step()
        opt.zero_grad()
    state = protrain.state_dict(model)
    stats = dict(opt.stats)
    protrain.close(model)
    torch.save(
        {"losses": losses, "state": state, "stats": stats},
        os.path.join(out_dir, f"{path}{rank}.pt"),
    )


@pytest.mark.parametrize("world,mode", [(2, "replicated"), (3, "sharded")])
def test_one_pass_and_fallback_equal_plain_pytorch(tmp_path, world, mode, one_pass_kernel):
    losses, _, state = _plain(False, world, "sum")
    runs = {}
    for path in ("one_pass", "torch"):
        run_ranks(world, _rank_train, mode, path, str(tmp_path))
        runs[path] = [torch.load(tmp_path / f"{path}{r}.pt") for r in range(world)]
    for path, results in runs.items():
        for r, res in enumerate(results):
            for i, loss in res["losses"]:
                assert loss == pytest.approx(losses[i], rel=1e-6, abs=1e-7), (path, r, i)
            for name, want in state.items():
                torch.testing.assert_close(
                    res["state"][name], want, rtol=1e-6, atol=1e-6, msg=f"{path} {r} {name}"
                )
            stats = res["stats"]
            per_param = stats["host_update_bytes"] / stats["host_update_params"]
            # fp32 weights: the one pass's 4 in, 24 of state, 4 out; torch's 28 and its
            # unscale-free clip pass (8)
            assert per_param == (32 if path == "one_pass" else 36), (path, r)
    for r in range(world):  # the two paths: the same update, to a few ulp of tails
        for name, value in runs["torch"][r]["state"].items():
            torch.testing.assert_close(
                runs["one_pass"][r]["state"][name], value, rtol=1e-6, atol=1e-7, msg=name
            )
