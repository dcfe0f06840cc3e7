"""Compact host moments (optimizer_state bf16 and 8bit) on several ranks (gloo on the CPU),
sharded on 2 and 3 ranks and replicated on 2: each rank's one pass steps the elements it
holds, its moments encoded over them (8-bit blocks laid from the shard's first element,
bf16 rounding bits drawn by the offset in the shard).

The reference runs the same one-pass kernel over the same pieces in one process, on plain
PyTorch's gradients, so it is exact on any vector width (the same tensors through the same
code; the kernel's arithmetic against torch's is tests/optim/test_state_format.py). Every
rank trains on the same micro-batch, its loss divided by the number of ranks, and the
ranks' gradients are summed: the sum of equal addends has one value in any order, so the
reduction order (gloo's, at 3 ranks) bounds nothing here and the reference sums as
autograd accumulates. No clipping: the global norm of sharded gradients is a sum over
ranks, in another order than one process's.

Each rank also saves after RESUME_AT steps (sharded: the moments gathered decoded to fp32),
resumes in a fresh engine (the moments encoded again over its own elements, which gives
back every code) and continues: bit for bit the uninterrupted run, through a state dict and
through a sharded checkpoint (``distributed/dcp_state.py``). A state dict marked with
another format is refused in one line, as is a sharded checkpoint's. Across world sizes (a
one-process checkpoint on the ranks, theirs on one process) each holder's moments are the
saved values encoded afresh over its own elements.
"""

from __future__ import annotations

import copy
import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from tests.engine.models import batches, build

import protrain
from protrain.distributed.dcp_flat import CheckpointMismatch, load_pieces, save_pieces
from protrain.distributed.dcp_state import pieces_to_save, plan_engine_load
from protrain.optim import state_format as sf
from protrain.train.checkpoint import sharded
from protrain.train.checkpoint.sharded import optimizer_param_names

from .ranks import run_ranks

STEPS, RESUME_AT, LR, WD = 3, 2, 1e-2, 0.01
BETAS, EPS = (0.9, 0.999), 1e-8


@pytest.fixture(autouse=True)
def _kernel(one_pass_kernel):
    """The compact formats run in the one pass only (tests/conftest.py)."""


def _wrap(model, mode, fmt):
    """``mode`` None: one process."""
    ranks = {} if mode is None else {"distributed_mode": mode, "grad_reduce": "sum"}
    return protrain.wrap(
        model,
        device="cpu",
        n_persist=0,
        lr=LR,
        weight_decay=WD,
        eps=EPS,
        chunk_size_bytes=16384,
        optimizer_state=fmt,
        **ranks,
    )


def _train(model, opt, data, world, start, stop):
    for step in range(start, stop):
        (model(**data[step]).loss / world).backward()
        opt.step()
        opt.zero_grad()


def _rank_train(rank, world, mode, fmt, out_dir):
    base = build("llama")
    data = batches("llama", STEPS)
    model, opt, layout = _wrap(copy.deepcopy(base), mode, fmt)
    assert layout.n_chunks > 2, layout
    slots = model._protrain_engine.manager.slots()
    pieces = {s.name: s.shard for s in slots if s.master is not None}
    names = optimizer_param_names(opt, model)
    _train(model, opt, data, world, 0, STEPS)
    whole = {"weights": protrain.state_dict(model), "optim": opt.state_dict()}
    protrain.close(model)

    model, opt, _ = _wrap(copy.deepcopy(base), mode, fmt)
    _train(model, opt, data, world, 0, RESUME_AT)
    codes = _own_codes(model, opt)
    saved = copy.deepcopy(opt.state_dict())
    weights = protrain.state_dict(model)
    protrain.close(model)
    restored = copy.deepcopy(base)
    restored.load_state_dict(weights)
    model, opt, _ = _wrap(restored, mode, fmt)
    for other in sorted(set(sf.STATE_FORMATS) - {fmt}):
        with pytest.raises(ValueError, match=f"saved with optimizer_state='{other}'") as e:
            opt.load_state_dict({**saved, "optimizer_state": other})
        assert "\n" not in str(e.value)
    opt.load_state_dict(saved)
    for (name, k), t in _own_codes(model, opt).items():  # encoded again: the same codes
        assert torch.equal(t, codes[(name, k)]), (rank, name, k)
    reloaded = opt.state_dict()
    _train(model, opt, data, world, RESUME_AT, STEPS)
    resumed = {"weights": protrain.state_dict(model), "optim": opt.state_dict()}
    protrain.close(model)
    result = {"pieces": pieces, "names": names, "whole": whole, "resumed": resumed}
    result |= {"saved": saved, "reloaded": reloaded}
    result["resumed_dcp"] = _resume_sharded_checkpoint(base, data, rank, world, mode, fmt, out_dir)
    model, opt, _ = _wrap(copy.deepcopy(base), mode, fmt)  # one process's checkpoint
    opt.load_state_dict(torch.load(os.path.join(out_dir, "one.pt")))
    result["from_one"] = _own_codes(model, opt)
    protrain.close(model)
    torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))


def _resume_sharded_checkpoint(base, data, rank, world, mode, fmt, out_dir) -> dict:
    """The same resume through a sharded checkpoint (``distributed/dcp_state.py``: moments
    saved decoded to fp32, encoded again on load): the weights and state after STEPS."""
    model, opt, _ = _wrap(copy.deepcopy(base), mode, fmt)
    _train(model, opt, data, world, 0, RESUME_AT)
    codes = _own_codes(model, opt)
    names = optimizer_param_names(opt, model)
    where = Path(out_dir) / f"dcp-{world}-{mode}-{fmt}"
    save_pieces(pieces_to_save(model, opt, names, rank, world), where, dist.group.WORLD)
    protrain.close(model)
    model, opt, _ = _wrap(copy.deepcopy(base), mode, fmt)
    load = plan_engine_load(model, opt, names, where)
    load_pieces(load.pieces, where, dist.group.WORLD)
    load.apply()
    for (name, k), t in _own_codes(model, opt).items():
        assert torch.equal(t, codes[(name, k)]), (rank, name, k)
    _train(model, opt, data, world, RESUME_AT, STEPS)
    out = {"weights": protrain.state_dict(model), "optim": opt.state_dict()}
    protrain.close(model)
    return out


def _own_codes(model, opt) -> dict:
    """This rank's compact state of each slot (its own elements), copied, once the host
    updates have run."""
    opt.synchronize()
    out = {}
    for s in model._protrain_engine.manager.slots():
        st = opt._opt_of(s).state.get(s.master) if s.master is not None else None
        for k, t in (st or {}).items():
            out[(s.name, k)] = t.clone()
    return out


def _reference(kernel, fmt, world, pieces):
    """Plain PyTorch's forward and backward (the gradient summed over ``world`` equal
    micro-batches), each parameter stepped by the one-pass kernel piece by piece as the
    ranks hold it: ``pieces[name]`` is the list of ``(lo, hi)``."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the ranks run
    try:
        model = build("llama")
        data = batches("llama", STEPS)
        params = dict(model.named_parameters())
        states = {n: [sf.new_moments(fmt, b - a, sf.n_blocks(b - a)) for a, b in pieces[n]]
                  for n in params}  # fmt: skip
        for step in range(STEPS):
            for _ in range(world):
                (model(**data[step]).loss / world).backward()
            with torch.no_grad():
                for n, p in params.items():
                    for (a, b), st in zip(pieces[n], states[n]):
                        _kernel_step(kernel, fmt, n, p, st, a, b, step + 1.0)
            model.zero_grad()
    finally:
        torch.set_num_threads(threads)
    moments = {}
    for n, p in params.items():
        decoded = [sf.decode_state(fmt, st) for st in states[n]]
        moments[n] = [torch.cat([d[i] for d in decoded]).view(p.shape) for i in range(2)]
    return {n: p.detach() for n, p in params.items()}, moments


def _kernel_step(kernel, fmt, name, p, st, a, b, step):
    master, grad = p.data.view(-1)[a:b], p.grad.view(-1)[a:b]
    none = torch.empty(0)
    kernel.adamw_step_compact(
        [master], [st["exp_avg"]], [st["exp_avg_sq"]],
        [st.get(sf.ABSMAX[0], none)], [st.get(sf.ABSMAX[1], none)],
        [grad], [torch.empty_like(master)], [step], [sf.param_seed(name)],
        sf.KERNEL_FORMAT[fmt], LR, *BETAS, WD, EPS, None, None,
    )  # fmt: skip


def _pieces(results, n_params):
    """Each parameter's ``(lo, hi)`` on each rank, in rank order (replicated: the whole)."""
    out = {}
    for name, shard in results[0]["pieces"].items():
        ranges = [res["pieces"][name] for res in results]
        out[name] = [(0, n_params[name])] if shard is None else [r for r in ranges if r[1] > r[0]]
    return out


def _fp32(fmt, st):
    """A state dict entry's moments as fp32 (a replicated rank's are compact)."""
    if st["exp_avg"].dtype == torch.float32:
        return st["exp_avg"].reshape(-1), st["exp_avg_sq"].reshape(-1)
    return sf.decode_state(fmt, st)


def _assert_equal_states(got, want, what):
    for i, st in want["state"].items():
        for k, v in st.items():
            assert torch.equal(got["state"][i][k], v), (what, i, k)


def _one_process_state(fmt, out_dir):
    """A one-process engine's state dict after RESUME_AT steps (its moments compact,
    encoded over whole parameters), saved for the ranks to load."""
    model, opt, _ = _wrap(build("llama"), None, fmt)
    _train(model, opt, batches("llama", STEPS), 1, 0, RESUME_AT)
    saved = opt.state_dict()
    protrain.close(model)
    torch.save(saved, os.path.join(out_dir, "one.pt"))
    return saved


def _encoded(fmt, st, lo, hi):
    """The elements ``[lo, hi)`` of a saved state (compact or fp32) encoded afresh."""
    m, v = _fp32(fmt, st)
    return sf.reencode_state(fmt, st["step"], m[lo:hi].contiguous(), v[lo:hi].contiguous())


def _assert_loaded_across_world_sizes(fmt, mode, one, results, pieces):
    """A one-process checkpoint on the ranks, and the ranks' on one process: each holds the
    saved values encoded afresh over its own elements (the same codes where the pieces are
    the saved ones: a replicated rank's, or a one-process engine's of a replicated run)."""
    names = results[0]["names"]
    for r, res in enumerate(results):
        for i, name in enumerate(names):
            a, b = res["pieces"][name] or (0, sum(h - lo for lo, h in pieces[name]))
            want = _encoded(fmt, one["state"][i], a, b) if b > a else {}
            for k, t in want.items():
                assert torch.equal(res["from_one"][(name, k)].reshape(-1), t.reshape(-1)), (
                    r,
                    name,
                    k,
                )
    model, opt, _ = _wrap(build("llama"), None, fmt)
    opt.load_state_dict(results[0]["saved"])
    for i, st in opt.state_dict()["state"].items():
        saved = results[0]["saved"]["state"][i]
        want = saved if mode == "replicated" else _encoded(fmt, saved, 0, saved["exp_avg"].numel())
        for k, t in want.items():
            assert torch.equal(st[k].reshape(-1), t.reshape(-1)), (names[i], k)
    protrain.close(model)


CASES = [(2, "sharded"), (3, "sharded"), (2, "replicated")]


@pytest.mark.parametrize("fmt", ["bf16", "8bit"])
@pytest.mark.parametrize("world,mode", CASES)
def test_compact_state_on_ranks(tmp_path, one_pass_kernel, world, mode, fmt):
    one = _one_process_state(fmt, str(tmp_path))
    run_ranks(world, _rank_train, mode, fmt, str(tmp_path))
    results = [torch.load(tmp_path / f"rank{r}.pt") for r in range(world)]
    n_params = {n: p.numel() for n, p in build("llama").named_parameters()}
    pieces = _pieces(results, n_params)
    if mode == "sharded":  # some parameter is split between ranks
        assert any(len(ranges) > 1 for ranges in pieces.values())
    weights, moments = _reference(one_pass_kernel, fmt, world, pieces)
    for r, res in enumerate(results):
        whole = res["whole"]
        for name, want in weights.items():
            assert torch.equal(whole["weights"][name], want), (r, name)
        assert whole["optim"]["optimizer_state"] == fmt
        for i, name in enumerate(res["names"]):
            m, v = _fp32(fmt, whole["optim"]["state"][i])
            assert torch.equal(m.view_as(moments[name][0]), moments[name][0]), (r, name)
            assert torch.equal(v.view_as(moments[name][1]), moments[name][1]), (r, name)
        _assert_equal_states(res["reloaded"], res["saved"], f"reloaded {r}")
        for name, value in whole["weights"].items():
            assert torch.equal(res["resumed"]["weights"][name], value), (r, name)
        _assert_equal_states(res["resumed"]["optim"], whole["optim"], f"resumed {r}")
        for name, value in whole["weights"].items():
            assert torch.equal(res["resumed_dcp"]["weights"][name], value), (r, name)
        _assert_equal_states(res["resumed_dcp"]["optim"], whole["optim"], f"sharded ckpt {r}")
        # every rank: the same whole state (replicated: the same seeds drew the same bits)
        _assert_equal_states(res["whole"]["optim"], results[0]["whole"]["optim"], f"rank {r}")
    _assert_loaded_across_world_sizes(fmt, mode, one, results, pieces)


@pytest.mark.parametrize("saved,have", [("bf16", "fp32"), (None, "8bit"), ("8bit", "bf16")])
def test_a_sharded_checkpoint_of_another_format_is_refused(tmp_path, saved, have):
    meta = {} if saved is None else {"optimizer_state": saved}  # None: before the marker
    optimizer = SimpleNamespace(state_format=have)
    with pytest.raises(CheckpointMismatch, match=f"saved with optimizer_state='{saved or 'fp32'}'"):
        sharded._check_markers(optimizer, meta, tmp_path)
