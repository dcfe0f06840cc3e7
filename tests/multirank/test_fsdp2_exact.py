"""The FSDP2 engine on 2 gloo ranks computes what one process of plain PyTorch computes, to
1e-6 in fp32 (the weights to 2e-6: see the comparison), bit for bit on some CPUs: both wrap policies (size-based with and
without `min_num_params`), with and without activation checkpointing, full fine-tuning,
LoRA and QLoRA, accumulation 2, global-norm clipping on; and the tiled MLP and the chunked
loss, with ranks whose sequences differ in length, issuing the same collectives. Explicit
backward prefetch (`backward_prefetch: BACKWARD_PRE`, the default) is on in every case;
the `prefetch-` cases add explicit forward prefetch, `no-prefetch-` leaves FSDP2's implicit
default.

The engine (`FSDP2Trainable`) is driven as the loop drives it: each step takes 2 x 2
micro-batches, rank r those at positions r and r + 2, each micro-batch's loss divided by
the trained tokens of the whole step, gradients summed over ranks.

The reference is one process: the same model (LoRA and 4-bit layers included), `loss_sum`
(with the same tiles and chunks where the case sets them), `torch.optim.AdamW(fused=True)`
over the same parameter groups and `clip_grad_norm_`. It adds the gradients up in the
order the engine does: the micro-batches of both ranks at one accumulation position summed
first, then the positions accumulated ([Note: gradients summed over ranks] in
`protrain.distributed.fsdp2`). Accumulating all four micro-batches one after another
instead moves weights by up to 5e-7 after 3 steps (AdamW turns the last-bit differences of
a gradient that cancels to about zero into updates of up to lr * |g| / eps), which is why
the torchrun tests compared to 1e-5 before.

The reference runs on one intra-op thread, as each rank does (`ranks.py`): the CPU's
matrix kernels split a product differently over another number of threads, which moved
the weights of the ragged tiled case by 9e-7 after 3 steps with the reference on 2 threads.
The clipping norm is combined from the ranks' shards (`sqrt(n0^2 + n1^2)` per tensor), so
it may differ from the one-process norm in its last bit.

All cases run in one spawn of two ranks (the start-up of two processes is most of the
time); the reference of each case runs in this process. Each rank ends as `protrain train`
ends (`stop_ranks`), which must free its process group: the units are garbage in cycles and
DTensor's caches keep their mesh ([Note: the meshes outlive the model] in
`protrain.distributed.fsdp2`), and a gloo group alive at interpreter exit can abort a rank.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from tests.engine.models import build, lora
from tests.train.helpers import tiny_config
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp._fully_shard._fsdp_collectives import (
    DefaultAllGather,
    DefaultReduceScatter,
)

from protrain.train.config import validate_config
from protrain.train.loss import count_trained_tokens, loss_sum
from protrain.train.trainable import optimizer_param_groups

from .ranks import run_ranks

WORLD, STEPS, ACCUM = 2, 3, 2
LR, WD, MAX_NORM = 1e-2, 0.01, 0.5
TILE, CHUNK = 4, 8
LONG, SHORT = 12, 7  # sequence lengths: rank 0 gets the long micro-batches, rank 1 the short

LAYERS = {"auto_wrap_policy": "TRANSFORMER_BASED_WRAP"}
SIZE = {"auto_wrap_policy": "SIZE_BASED_WRAP"}  # the default 1e8: everything in the root
SIZE_1K = {"auto_wrap_policy": "SIZE_BASED_WRAP", "min_num_params": 1000}  # sub-layer units
AC = {"activation_checkpointing": True}
FWD_PREFETCH = {"forward_prefetch": True}

# name: (fsdp_config, model kind, memory options, ranks' sequences differ)
CASES: dict[str, tuple[dict, str, dict, bool]] = {}
for _policy, _fsdp in (("layers", LAYERS), ("size-default", SIZE), ("size-1k", SIZE_1K)):
    for _ac in (False, True):
        for _kind in ("full", "lora"):
            _name = f"{_policy}{'-ac' if _ac else ''}-{_kind}"
            CASES[_name] = ({**_fsdp, **(AC if _ac else {})}, _kind, {}, False)
CASES.update(
    {
        "qlora-layers": (LAYERS, "qlora", {}, False),
        "qlora-size-1k-ac": ({**SIZE_1K, **AC}, "qlora", {}, False),
        "tiled-layers": (LAYERS, "full", {"tiled_mlp_tokens": TILE}, True),
        "tiled-size-1k-ac": ({**SIZE_1K, **AC}, "full", {"tiled_mlp_tokens": TILE}, True),
        "chunked-layers-lora": (LAYERS, "lora", {"chunked_loss_tokens": CHUNK}, True),
        "chunked-size-1k": (SIZE_1K, "full", {"chunked_loss_tokens": CHUNK}, True),
        "tiled-chunked-size-1k-ac": (
            {**SIZE_1K, **AC},
            "lora",
            {"tiled_mlp_tokens": TILE, "chunked_loss_tokens": CHUNK},
            True,
        ),
        # explicit prefetch (backward BACKWARD_PRE is the default of every case above)
        "prefetch-layers-full": ({**LAYERS, **FWD_PREFETCH}, "full", {}, False),
        "prefetch-size-1k-ac-lora": ({**SIZE_1K, **AC, **FWD_PREFETCH}, "lora", {}, False),
        "prefetch-tiled-chunked-layers-lora": (
            {**LAYERS, **FWD_PREFETCH},
            "lora",
            {"tiled_mlp_tokens": TILE, "chunked_loss_tokens": CHUNK},
            True,
        ),
        "no-prefetch-size-1k-full": (
            {**SIZE_1K, "backward_prefetch": "NO_PREFETCH"},
            "full",
            {},
            False,
        ),
    }
)


def _model(kind: str) -> torch.nn.Module:
    model = build("llama")
    if kind == "qlora":
        from protrain.quant import quantize_linear_4bit

        model = quantize_linear_4bit(model, compute_dtype=torch.float32)
    return model if kind == "full" else lora(model, "llama")


def _data(ragged: bool) -> list[dict[str, torch.Tensor]]:
    """The micro-batches of every step in order; some labels masked. ``ragged``: those of
    rank 1 (odd positions) shorter, so that the ranks' tiles and chunks differ in number."""
    g = torch.Generator().manual_seed(1)
    out = []
    for k in range(STEPS * ACCUM * WORLD):
        seq = SHORT if ragged and k % WORLD else LONG
        ids = torch.randint(1, 95, (2, seq), generator=g)
        labels = ids.clone()
        labels[0, : k % 3] = -100
        out.append({"input_ids": ids, "labels": labels})
    return out


def _step_batches(data: list, step: int) -> tuple[list, int]:
    window = data[step * ACCUM * WORLD : (step + 1) * ACCUM * WORLD]
    return window, sum(count_trained_tokens(b["labels"]) for b in window)


def _config(tmp: Path, fsdp: dict, memory: dict):
    cfg = tiny_config(
        tmp,
        fsdp_version=2,
        fsdp_config=fsdp,
        learning_rate=LR,
        weight_decay=WD,
        max_grad_norm=MAX_NORM,
        gradient_accumulation_steps=ACCUM,
    )
    if memory:
        cfg["memory"] = memory
    return validate_config(cfg)


class _Counted:
    """FSDP2's default collectives, counted (installed through its public
    `set_custom_all_gather` / `set_custom_reduce_scatter`)."""

    def __init__(self, counts: dict[str, int]):
        counts.update(all_gather=0, reduce_scatter=0)
        outer = self

        class AllGather(DefaultAllGather):
            def __call__(self, *args, **kwargs):
                counts["all_gather"] += 1
                return super().__call__(*args, **kwargs)

        class ReduceScatter(DefaultReduceScatter):
            def __call__(self, *args, **kwargs):
                counts["reduce_scatter"] += 1
                return super().__call__(*args, **kwargs)

        outer.all_gather, outer.reduce_scatter = AllGather(), ReduceScatter()

    def install(self, model: torch.nn.Module) -> None:
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_custom_all_gather(self.all_gather)
                module.set_custom_reduce_scatter(self.reduce_scatter)


def _rank_train(rank: int, world: int, tmp: str) -> None:
    from protrain.train.fsdp2_trainable import FSDP2Trainable
    from protrain.train.ranks import stop_ranks

    results = {}
    for name, (fsdp, kind, memory, ragged) in CASES.items():
        trainable = FSDP2Trainable(
            _model(kind), _config(Path(tmp), fsdp, memory), torch.device("cpu"), None
        )
        counts: dict[str, int] = {}
        _Counted(counts).install(trainable.model)
        data = _data(ragged)
        losses, norms = {}, []
        for step in range(STEPS):
            window, n_trained = _step_batches(data, step)
            mine = [(k, b) for k, b in enumerate(window) if k % world == rank]
            for i, (k, batch) in enumerate(mine):
                loss = trainable.forward_loss_sum(batch)
                losses[step * ACCUM * world + k] = loss.item()
                trainable.backward(loss / n_trained, last=i == len(mine) - 1)
            norms.append(trainable.clip_grad_norm(MAX_NORM))
            trainable.optimizer_step()
        results[name] = {
            "losses": losses,
            "norms": norms,
            "state": trainable.model_state(),  # whole on rank 0 (a collective)
            "units": trainable.units,
            "counts": dict(counts),
        }
        trainable.close()
    torch.save(results, os.path.join(tmp, f"rank{rank}.pt"))
    del trainable, loss  # the run is over: the group ends as `protrain train` ends it
    stop_ranks()


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    """One intra-op thread, as in every rank."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@one_thread()
def _plain(kind: str, memory: dict, ragged: bool):
    model = _model(kind)
    handle = None
    if memory.get("tiled_mlp_tokens"):
        from protrain.activations import apply_tiled_mlp

        handle = apply_tiled_mlp(model, tile_tokens=memory["tiled_mlp_tokens"])
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(optimizer_param_groups(model, WD), lr=LR, fused=True)
    data = _data(ragged)
    cpu = torch.device("cpu")
    losses, norms = {}, []
    for step in range(STEPS):
        window, n_trained = _step_batches(data, step)
        total = None
        for position in range(ACCUM):
            summed = None
            for rank in range(WORLD):
                k = position * WORLD + rank
                loss = loss_sum(model, window[k], cpu, memory.get("chunked_loss_tokens"))
                losses[step * ACCUM * WORLD + k] = loss.item()
                (loss / n_trained).backward()
                grads = [p.grad for p in params]
                summed = grads if summed is None else [a + b for a, b in zip(summed, grads)]
                opt.zero_grad(set_to_none=True)
            total = summed if total is None else [a + b for a, b in zip(total, summed)]
        for p, g in zip(params, total):
            p.grad = g
        norms.append(torch.nn.utils.clip_grad_norm_(params, MAX_NORM).item())
        opt.step()
        opt.zero_grad(set_to_none=True)
    if handle is not None:
        handle.remove()
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    state = dict(model.named_parameters())
    return losses, norms, {n: state[n].detach() for n in names}


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    tmp = tmp_path_factory.mktemp("fsdp2")
    run_ranks(WORLD, _rank_train, str(tmp), check_group_freed=True)
    return [torch.load(tmp / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]


@pytest.mark.parametrize("case", list(CASES))
def test_two_ranks_equal_one_process(ranks, case):
    fsdp, kind, memory, ragged = CASES[case]
    losses, norms, state = _plain(kind, memory, ragged)
    first, second = ranks[0][case], ranks[1][case]
    got_losses = {**first["losses"], **second["losses"]}
    assert sorted(got_losses) == sorted(losses)
    for k, want in losses.items():
        assert got_losses[k] == pytest.approx(want, rel=1e-6, abs=1e-7), k
    for res in (first, second):
        assert res["norms"] == pytest.approx(norms, rel=1e-6)
    got = first["state"]
    assert set(got) == set(state)
    for name, want in state.items():
        # 2e-6: on some CPUs (on others this is bit for bit) the
        # full fine-tuning cases moved one k_proj element of 512 by 1.13e-6, the others by at
        # most 2.2e-7: AdamW's lr * |g| / eps on a gradient that cancels to about zero (see
        # the module docstring). The losses and clipping norms stay within 1e-6.
        torch.testing.assert_close(got[name], want, rtol=1e-6, atol=2e-6, msg=name)
    # every rank issued the same collectives (any mismatch would also have hung the run)
    assert first["counts"] == second["counts"]
    assert first["counts"]["all_gather"] > 0 and first["counts"]["reduce_scatter"] > 0
    assert first["units"] == second["units"]


def test_units_where_hooks_run_once(ranks):
    """The wrap policies' units, and those left out under the tiled MLP and the chunked
    loss: the output layer (called once per chunk) and the MLP's projections (once per
    tile) stay in the unit above them."""
    units = {case: ranks[0][case]["units"] for case in CASES}
    assert units["layers-full"] == [f"model.layers.{i}" for i in (2, 1, 0)]
    assert units["size-default-full"] == []
    assert "lm_head" in units["size-1k-full"]
    assert "model.layers.0.mlp.up_proj" in units["size-1k-full"]
    assert "lm_head" not in units["chunked-size-1k"]
    assert not any(".mlp." in u for u in units["tiled-size-1k-ac"])
    assert not any(".mlp." in u or "lm_head" in u for u in units["tiled-chunked-size-1k-ac"])
