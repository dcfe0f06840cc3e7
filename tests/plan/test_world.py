"""Plans for several ranks (``plan/world.py``): each rank's host share, the reduce buckets,
the collectives' seconds, and the mode the search picks. Synthetic profiles: no trace."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from plan_synthetic import MIB, hardware, profile

from protrain.knobs import Knobs
from protrain.plan.chunk_size import search_chunk_sizes
from protrain.plan.memory import MemoryModel
from protrain.plan.request import PlanRequest
from protrain.plan.runtime import RuntimeModel
from protrain.plan.search import PlanProblem, search
from protrain.plan.world import SINGLE, World


def _hw(**rates):
    base = dict(
        collective_bytes_per_s=100e9,
        all_gather_bytes_per_s=80e9,
        all_gather_busy_bytes_per_s=64e9,
        reduce_scatter_bytes_per_s=50e9,
        world_size=2,
        local_world_size=2,
    )
    return dataclasses.replace(hardware(), **{**base, **rates})


def test_world_checks_its_values():
    with pytest.raises(ValueError, match="mode='zero3' is not allowed"):
        World(2, 2, "zero3")
    with pytest.raises(ValueError, match="local_size=3 is not in 1..size=2"):
        World(2, 3)
    assert World(4, 2, "sharded").shards == 4
    assert World(4, 2, "replicated").shards == 1
    assert SINGLE.shards == 1 and SINGLE.distributed_mode is None


def test_host_memory_is_each_ranks_shard_and_buckets_are_counted():
    p = profile(6, 8)
    one = MemoryModel(p)
    sharded = MemoryModel(p, World(2, 2, "sharded"))
    replicated = MemoryModel(p, World(2, 2, "replicated"))
    per_chunk_one = -np.diff(one.host_suffix)
    per_chunk_sharded = -np.diff(sharded.host_suffix)
    assert np.array_equal(per_chunk_sharded, -(-per_chunk_one // 2))
    assert np.array_equal(replicated.host_suffix, one.host_suffix)
    chunk = p.chunks.chunk_size_bytes
    assert one.reduce_buckets == 0
    assert sharded.reduce_buckets == 2 * chunk + chunk // 2
    assert replicated.reduce_buckets == 3 * chunk
    # they are live in backward (the head's included), not in forward
    bwd = np.isin(sharded.iv_kind, ("bwd", "head"))
    assert np.array_equal(sharded.iv_base - one.iv_base, np.where(bwd, sharded.reduce_buckets, 0))
    act = [m.activation_peak(0, 6, 2)[0] for m in (one, sharded)]
    assert act[0] <= act[1] <= act[0] + sharded.reduce_buckets


def test_collective_seconds_count_each_chunks_collectives():
    p = profile(6, 8)
    hw = _hw()
    chunk = p.chunks.chunk_size_bytes
    trn = np.asarray(p.chunks.trainable_numel) > 0
    bus = chunk / 2  # (N - 1) / N of the chunk at N = 2
    n_p, n_b = 2, 3
    n_off = 8 - n_p
    sharded = RuntimeModel(p, hw, world=World(2, 2, "sharded"))
    fwd, bwd = sharded.collective_seconds(n_p, n_b)
    assert fwd == pytest.approx(n_off * bus / 64e9)  # the all-gather beside copies
    want_bwd = ((n_off - n_b) * bus / 64e9 + trn[n_p:].sum() * bus / 50e9
                + trn[:n_p].sum() * 2 * bus / 100e9)  # fmt: skip
    assert bwd == pytest.approx(want_bwd)
    replicated = RuntimeModel(p, hw, world=World(2, 2, "replicated"))
    fwd, bwd = replicated.collective_seconds(n_p, n_b)
    assert fwd == 0 and bwd == pytest.approx(trn.sum() * 2 * bus / 100e9)
    # a rank copies its shard: half the single rank's gather bytes, and half its host step
    one = RuntimeModel(p, hw)
    _, t_one = one.step_s(n_p, n_b, 1.0, 0, breakdown=True)
    _, t_sh = sharded.step_s(n_p, n_b, 1.0, 0, breakdown=True)
    assert t_sh["h2d_bytes"] == pytest.approx(t_one["h2d_bytes"] / 2)
    assert t_sh["host_optimizer"] == pytest.approx(t_one["host_optimizer"] / 2)
    assert t_one["collective"] == 0 and t_sh["collective"] > 0


def test_a_world_without_collective_rates_is_an_error():
    with pytest.raises(ValueError, match="no collective bandwidths"):
        RuntimeModel(profile(4, 6), hardware(), world=World(2, 2))


def test_search_picks_the_mode_whose_host_share_fits():
    p = profile(6, 8)
    hw = _hw()
    one = PlanProblem(p, hw, gpu_budget_bytes=10**12)
    host_all = int(one.memory.host_suffix[0])
    budget = dict(gpu_budget_bytes=int(p.chunks.chunk_size_bytes * 4 + 2048 * MIB))
    # room on the host for each rank's half of the offloaded state, not for all of it
    request = PlanRequest(**budget, cpu_budget_bytes=host_all * 3 // 4,
                          knobs=Knobs(chunk_size_bytes=p.chunks.chunk_size_bytes))  # fmt: skip
    result, problem = search_chunk_sizes(None, p, hw, request, world=World(2, 2), mode_fixed=False)
    plan = result.plan
    assert (plan.world_size, plan.distributed_mode) == (2, "sharded")
    assert problem.world.mode == "sharded"
    assert any("mode sharded over 2 ranks" in r and "replicated" in r for r in plan.reasons)
    # a fixed mode is kept
    fixed = search(PlanProblem(p, hw, **budget, world=World(2, 2, "replicated"))).plan
    assert fixed.distributed_mode == "replicated"
