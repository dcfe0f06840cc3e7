"""A planned wrap (``gpu_budget``) on several ranks: measured together, planned on the first
rank, the same plan on every rank, the same math as one process; a planning error on the
first rank raised on every rank (gloo on the CPU). One launch of the ranks runs every case:
starting them is most of the time on two cores."""

from __future__ import annotations

import os

import pytest
import torch
from tests.engine.models import batches

import protrain
from protrain.plan import NoPlanFits

from .ranks import run_ranks
from .test_engine_exact import ACCUM, LR, MAX_NORM, STEPS, WD, _model, _plain

WORLD = 2
MODES = [None, "replicated"]  # None: the planner chooses


def _train_planned(rank, world, mode):
    data = batches("llama", STEPS * ACCUM * world)
    model, opt, _ = protrain.wrap(
        _model(False), device="cpu", lr=LR, weight_decay=WD, chunk_size_bytes=16384,
        n_persist=1, gpu_budget="64MiB", sample_batch=data[0], distributed_mode=mode,
        grad_reduce="sum",
    )  # fmt: skip
    plan = protrain.plan_of(model)
    losses, norms = [], []
    for step in range(STEPS):
        for mb in range(ACCUM):
            i = step * ACCUM * world + mb * world + rank
            loss = model(**data[i]).loss / (ACCUM * world)
            loss.backward()
            losses.append((i, loss.item()))
        norms.append(opt.clip_grad_norm_(MAX_NORM).item())
        opt.step()
        opt.zero_grad()
    sharded = [c.shard is not None for c in model._protrain_engine.manager.chunks]
    out = {"plan": plan.to_dict(), "losses": losses, "norms": norms, "sharded": sharded,
           "state": protrain.state_dict(model)}  # fmt: skip
    protrain.close(model)
    return out


def _no_plan_message() -> str:
    data = batches("llama", 1)
    try:
        protrain.wrap(_model(False), device="cpu", gpu_budget="1KiB", sample_batch=data[0])
    except NoPlanFits as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def _rank(rank, world, cache, out_dir):
    os.environ["PROTRAIN_CACHE_DIR"] = cache
    out = {"runs": [_train_planned(rank, world, mode) for mode in MODES]}
    out["no_plan"] = _no_plan_message()
    torch.save(out, os.path.join(out_dir, f"rank{rank}.pt"))


def test_planned_wraps_on_two_ranks(tmp_path):
    run_ranks(WORLD, _rank, str(tmp_path / "cache"), str(tmp_path))
    res = [torch.load(tmp_path / f"rank{r}.pt") for r in range(WORLD)]
    losses, norms, state = _plain(False, WORLD, "sum")
    for k, mode in enumerate(MODES):
        plan = res[0]["runs"][k]["plan"]
        assert res[1]["runs"][k]["plan"] == plan  # one plan, every rank
        assert plan["world_size"] == WORLD and plan["n_persist"] == 1
        assert plan["distributed_mode"] in ("sharded", "replicated")
        if mode is not None:  # a fixed mode is kept; else the reasons say why this one
            assert plan["distributed_mode"] == mode
        else:
            assert any(f"over {WORLD} ranks" in r for r in plan["reasons"]), plan["reasons"]
        assert plan["time_terms"]["collective"] > 0
        want_sharded = plan["distributed_mode"] == "sharded"
        for r in res:
            run = r["runs"][k]
            assert run["sharded"][1:] == [want_sharded] * (len(run["sharded"]) - 1)
            for i, loss in run["losses"]:
                assert loss == pytest.approx(losses[i], rel=1e-6, abs=1e-7), (mode, i)
            assert run["norms"] == pytest.approx(norms, rel=1e-6)
            for name, want in state.items():
                torch.testing.assert_close(run["state"][name], want, rtol=1e-6, atol=1e-6)
    # the hardware profile: measured by both ranks together, cached once, with the group's
    cached = list((tmp_path / "cache").glob("hardware-*.json"))
    assert len(cached) == 1
    text = cached[0].read_text()
    assert '"world_size": 2' in text and '"all_gather_bytes_per_s": null' not in text
    # a planning error on the first rank is every rank's, with its message
    assert res[0]["no_plan"] == res[1]["no_plan"]
    assert res[0]["no_plan"].startswith("NoPlanFits: no plan fits the GPU budget")
