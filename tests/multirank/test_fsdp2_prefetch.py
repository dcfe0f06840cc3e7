"""Explicit prefetch of the FSDP2 engine: the lists set on each sharded unit are its
neighbours in forward and backward order, for both wrap policies, nested units and a
frozen first unit ([Note: explicit prefetch] in `protrain.distributed.fsdp2.units`). One
process, a process group of one rank; `test_fsdp2_exact.py` trains with prefetch on two.

FSDP2 has no getter for the lists: the test reads them back from the unit's FSDP state
(`_get_fsdp_state()._states_to_*_prefetch`, private, torch 2.11 and 2.13), each state
mapped to its module through `_modules`, to check what `fully_shard` was actually told.
"""

from __future__ import annotations

import logging

import pytest
import torch
import torch.distributed as dist
from tests.engine.models import build
from tests.train.helpers import tiny_config
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule

from protrain.distributed.fsdp2 import (
    SIZE_BASED_WRAP,
    TRANSFORMER_BASED_WRAP,
    FSDP2Settings,
    apply_fsdp2,
)
from protrain.train.config import validate_config
from protrain.train.errors import ConfigError


@pytest.fixture
def one_rank():
    started = not dist.is_initialized()
    if started:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield init_device_mesh("cpu", (1,))
    if started:
        dist.destroy_process_group()


def _set_lists(model: nn.Module) -> dict[str, tuple[list[str], list[str]]]:
    """Each unit's (forward, backward) prefetch targets as FSDP2 holds them."""
    names = {id(m): n for n, m in model.named_modules()}
    out = {}
    for name, module in model.named_modules():
        if isinstance(module, FSDPModule):
            state = module._get_fsdp_state()
            out[name] = tuple(
                [names[id(m)] for s in states for m in s._modules]
                for states in (
                    state._states_to_forward_prefetch,
                    state._states_to_backward_prefetch,
                )
            )
    return out


def _shard(model: nn.Module, mesh, **settings) -> dict[str, tuple[list[str], list[str]]]:
    apply_fsdp2(model, FSDP2Settings(**settings), mesh)
    return _set_lists(model)


def test_layer_units_prefetch_their_neighbours(one_rank):
    model = build("llama")
    got = _shard(
        model,
        one_rank,
        auto_wrap_policy=TRANSFORMER_BASED_WRAP,
        layer_classes=("LlamaDecoderLayer",),
        forward_prefetch=True,
    )
    layer = "model.layers.{}".format
    assert got == {
        "": ([layer(0)], [layer(2)]),
        layer(0): ([layer(1)], []),
        layer(1): ([layer(2)], [layer(0)]),
        layer(2): ([], [layer(1)]),
    }


class _Nested(nn.Module):
    """Size-based units at min_num_params 1000: embed, head, `block.a`, and `block`
    around it (the parameters it has left, b and c, reach 1000)."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(100, 16)  # 1600
        self.block = nn.Module()
        self.block.a = nn.Linear(16, 64)  # 1088
        self.block.b = nn.Linear(64, 14)  # 910
        self.block.c = nn.Linear(14, 16)  # 240
        self.head = nn.Linear(16, 100, bias=False)  # 1600


SIZE_1K = dict(auto_wrap_policy=SIZE_BASED_WRAP, min_num_params=1000)


def test_nested_size_based_units(one_rank):
    """Forward: the root, then pre-order (block before block.a); backward: the reverse
    post-order (block's pre-backward fires before block.a's)."""
    got = _shard(_Nested(), one_rank, **SIZE_1K, forward_prefetch=True)
    assert got == {
        "": (["embed"], ["head"]),
        "embed": (["block"], []),
        "block": (["block.a"], ["block.a"]),
        "block.a": (["head"], ["embed"]),
        "head": ([], ["block"]),
    }


def test_frozen_first_unit_is_not_prefetched_in_backward(one_rank):
    """A frozen embedding's outputs need no gradient: its pre-backward never fires, so no
    unit prefetches it in backward; forward prefetch off leaves the forward lists empty."""
    model = _Nested()
    model.embed.weight.requires_grad_(False)
    got = _shard(model, one_rank, **SIZE_1K)
    assert got["block.a"] == ([], [])
    assert got["embed"] == ([], [])
    assert got[""] == ([], ["head"])


def test_backward_prefetch_off_keeps_fsdp2_default(one_rank):
    got = _shard(_Nested(), one_rank, **SIZE_1K, backward_prefetch=False)
    assert all(lists == ([], []) for lists in got.values())


def test_prefetch_keys(tmp_path):
    def fsdp(**keys):
        return validate_config(tiny_config(tmp_path, fsdp_version=2, fsdp_config=keys)).fsdp

    default = fsdp()
    assert (default.forward_prefetch, default.backward_prefetch) == (False, "BACKWARD_PRE")
    spelled = fsdp(fsdp_forward_prefetch=True, fsdp_backward_prefetch="NO_PREFETCH")
    assert (spelled.forward_prefetch, spelled.backward_prefetch) == (True, "NO_PREFETCH")
    with pytest.raises(ConfigError) as info:
        fsdp(backward_prefetch="BACKWARD_LATE")
    message = str(info.value)
    assert "\n" not in message
    assert "fsdp_config.backward_prefetch = 'BACKWARD_LATE' is not allowed" in message
    assert "'BACKWARD_PRE', 'BACKWARD_POST' or 'NO_PREFETCH'" in message
    with pytest.raises(ConfigError, match="fsdp_config.forward_prefetch = 'sometimes'"):
        fsdp(forward_prefetch="sometimes")


def test_trainable_sets_prefetch(tmp_path):
    """Through the engine (`FSDP2Trainable`, one process): the config's keys reach FSDP2."""
    from protrain.train.fsdp2_trainable import FSDP2Trainable

    cfg = validate_config(
        tiny_config(
            tmp_path,
            fsdp_version=2,
            fsdp_config={"auto_wrap_policy": "TRANSFORMER_BASED_WRAP", "forward_prefetch": True},
        )
    )
    trainable = FSDP2Trainable(build("llama"), cfg, torch.device("cpu"), None)
    try:
        got = _set_lists(trainable.model)
        assert got["model.layers.0"] == (["model.layers.1"], [])
        assert got[""] == (["model.layers.0"], ["model.layers.2"])
    finally:
        trainable.close()


class _Reversed(nn.Module):
    """`late` is registered first and runs second."""

    def __init__(self):
        super().__init__()
        self.late = nn.Linear(32, 32)  # 1056
        self.early = nn.Linear(32, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.late(self.early(x))


def test_first_forward_corrects_the_order(one_rank):
    """The module tree says late, early; the first forward with gradients sees early, late:
    the lists follow what ran, and a warning says so. A forward without gradients first
    changes nothing."""
    model = _Reversed()
    got = _shard(model, one_rank, **SIZE_1K, forward_prefetch=True)
    assert got[""] == (["late"], ["early"]) and got["late"] == (["early"], [])
    x = torch.randn(2, 32)
    with torch.no_grad():
        model(x)
    assert _set_lists(model) == got
    # a handler on the logger itself: `protrain` may not propagate to pytest's caplog
    warnings: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: warnings.append(record.getMessage())
    log = logging.getLogger("protrain.distributed.fsdp2")
    log.addHandler(handler)
    try:
        model(x).sum().backward()
    finally:
        log.removeHandler(handler)
    assert _set_lists(model) == {
        "": (["early"], ["late"]),
        "early": (["late"], []),
        "late": ([], ["early"]),
    }
    assert len(warnings) == 1 and "at 1: 'early' instead of 'late'" in warnings[0]
