"""The step-time model against the engine's behaviour (docs/design.md, engine sections)."""

from __future__ import annotations

import dataclasses

import numpy as np
import plan_synthetic as syn
import pytest

from protrain.optim.hybrid_adamw import _UPDATE_PIECE_NUMEL
from protrain.plan import PlanProblem, search
from protrain.plan.memory import SWAP
from protrain.plan.runtime import RuntimeModel, _lowest_first
from protrain.plan.search import PLAIN_MARGIN
from protrain.profile.chunk_table import ChunkTable
from protrain.profile.trace import BlockProfile, Interval, ModelProfile

GIB = 1 << 30


def llama1b_like(free: bool = True) -> ModelProfile:
    """The shape of fits-b1 on one H200: 3 chunks of ~427 M bf16 parameters, 16 blocks,
    a free-running forward + backward of 0.09 s (keep-all)."""
    n_blocks, chunk = 16, 854 * (1 << 20)
    blocks = [
        BlockProfile(f"layers.{i}", 0.003, 0.006, 0.003, 200 << 20, 8 << 20, True,
                     210 << 20, 24 << 20)
        for i in range(n_blocks)
    ]  # fmt: skip
    trn = [chunk // 2] * 3
    table = ChunkTable(
        chunk_size_bytes=chunk,
        used_bytes=[chunk] * 3,
        trainable_numel=trn,
        trainable_bytes=[2 * n for n in trn],
        trainable_tensors=[40] * 3,
        max_trainable_numel=[262_668_288, 8 << 20, 8 << 20],  # chunk 0 holds the embedding
        min_buffers=1,
    )
    ivs = [Interval("pre", -1, 0, 0.001, 0, 0, 0, 0), Interval("head", -1, 0, 0.01, 1, 0, 0, 0),
           Interval("opt", -1, 0, 0.01, 0, 0, 0, 0)]  # fmt: skip
    return ModelProfile(
        blocks=blocks, intervals=ivs, chunks=table, batch_size=1, seq_len=2048,
        device="cuda", compute_dtype="bfloat16", trace_n_persist=3, trace_n_buffer=0,
        step_s=0.2, pre_fwd_s=0.001, head_s=0.01, post_bwd_s=0.0, optimizer_step_s=0.02,
        allocator_overhead_bytes=0, step_start_bytes=0,
        free_pre_fwd_s=0.001 if free else None, free_blocks_fwd_s=0.03 if free else None,
        free_fwd_bwd_s=0.12 if free else None, chunk_first_block=[-1, 5, 11],
    )  # fmt: skip


def h200_like():
    return dataclasses.replace(
        syn.hardware(), cpu_adam_params_per_s=4.1e9, device_adam_params_per_s=50e9
    )


def test_free_running_step_is_the_compute():
    rt = RuntimeModel(llama1b_like(), h200_like())
    assert rt.base_compute_s == pytest.approx(0.12 - 0.03)  # checkpoint-all less its recompute
    assert rt.recompute_s.sum() == pytest.approx(0.03)
    synced = RuntimeModel(llama1b_like(free=False), h200_like())
    assert synced.base_compute_s == pytest.approx(0.001 + 16 * 0.009 + 0.01)


def test_the_measured_plain_step_is_the_base_and_the_difference_the_recompute():
    """[Note: the plain layout measured]: with the step of nothing recomputed measured, a
    plan recomputing no block costs that step and one recomputing all of them the
    checkpointed step; the recompute is shared by the blocks' forward times."""
    prof = dataclasses.replace(llama1b_like(), free_keep_fwd_bwd_s=0.07)
    rt = RuntimeModel(prof, h200_like())
    assert rt.base_compute_s == pytest.approx(0.07)
    assert rt.recompute_s.sum() == pytest.approx(0.12 - 0.07)
    assert rt.recompute_s == pytest.approx(np.full(16, 0.05 / 16))
    assert rt.fwd_compute_s == pytest.approx(0.001 + 0.03)  # the forward: as before
    # a faster checkpointed step than the plain one (noise): no negative recompute
    odd = RuntimeModel(dataclasses.replace(prof, free_keep_fwd_bwd_s=0.13), h200_like())
    assert odd.recompute_s.sum() == 0.0 and odd.base_compute_s == pytest.approx(0.13)


def _last_chunk_terms(p, hw) -> dict[str, float]:
    """The host-stall terms of the 1B-like profile's last chunk when it alone is offloaded:
    its largest gradient's copy out, its host AdamW, the copy in of its last update piece,
    when the forward needs it (after block 11) and the device AdamW of the other two."""
    trn, largest = p.chunks.trainable_numel[2], p.chunks.max_trainable_numel[2]
    return {
        "grad_tail": 4 * largest / hw.d2h_bytes_per_s,
        "host": trn / hw.cpu_adam_params_per_s,
        "last_piece": 4 * min(trn, max(largest, _UPDATE_PIECE_NUMEL)) / hw.h2d_bytes_per_s,
        "needed": 0.001 + 11 * (0.03 / 16),
        "dev_opt": 2 * trn / hw.device_adam_params_per_s,
    }


def test_host_stall_with_clipping_is_the_critical_path():
    """One offloaded chunk (the last): its step starts after the embedding's gradient is on
    the host, then the masters of its last update piece are copied in (the pieces before
    are copied while the next ones update); the forward reaches it after block 11."""
    p, hw = llama1b_like(), h200_like()
    rt = RuntimeModel(p, hw, clipping=True)
    t = _last_chunk_terms(p, hw)
    expected = t["grad_tail"] + t["host"] + t["last_piece"] - t["needed"] - t["dev_opt"]
    assert rt.host_stall_s[2] == pytest.approx(expected)
    assert rt.host_stall_s[3] == 0.0
    # Without clipping each chunk's step starts during backward, as soon as its gradients
    # are on the host, and the worker takes the first chunk the forward needs first: with
    # one or every chunk offloaded, no later than clipping's schedule.
    no_clip = RuntimeModel(p, hw, clipping=False)
    assert no_clip.host_stall_s[2] < rt.host_stall_s[2]
    assert no_clip.host_stall_s[0] < rt.host_stall_s[0]


def test_without_clipping_pieces_start_as_their_blocks_finish_backward():
    """The last chunk spans blocks 11-15: its first piece is released once block 15's
    backward is done, not block 11's, and its pieces (0.02 s of host work each) outlast a
    block's backward, so the host runs from then on without a gap."""
    p, hw = llama1b_like(), h200_like()
    rt = RuntimeModel(p, hw, clipping=False)
    t = _last_chunk_terms(p, hw)
    after_15 = rt.block_bwd_s[:15].sum()  # backward still to run when block 15's is done
    expected = t["grad_tail"] - after_15 + t["host"] + t["last_piece"] - t["needed"]
    expected -= t["dev_opt"]
    assert rt.host_stall_s[2] == pytest.approx(expected)


def test_a_one_piece_update_is_released_after_its_chunks_first_block():
    """A chunk whose trainable part is one update piece (LoRA) starts its host step only
    when backward has finished the first block it spans, as the engine does."""
    p = llama1b_like()
    small = [p.chunks.trainable_numel[0], 1 << 20, 1 << 20]
    chunks = dataclasses.replace(p.chunks, trainable_numel=small, max_trainable_numel=small)
    rt = RuntimeModel(dataclasses.replace(p, chunks=chunks), h200_like(), clipping=False)
    last = rt._task_chunk == 2
    assert last.sum() == 1
    assert rt._task_bwd_after[last][0] == pytest.approx(rt.block_bwd_s[:11].sum())


def test_host_worker_schedule_is_lowest_position_first():
    """Chunks released in backward order (last first): the worker runs each as soon as it
    is released while idle, and a backlog in forward order."""
    release = np.array([-0.1, -0.2, -0.3, -0.4])  # chunk 3's gradients land first
    work = np.array([0.25, 0.25, 0.25, 0.25])
    done = _lowest_first(release, work, np.array([True, True, True, True]))
    # 3 runs from -0.4; at -0.15 chunks 2 and 1 are waiting: 1 first, then 0 (released at
    # -0.1, lower than 2), then 2
    assert done.tolist() == pytest.approx([0.35, 0.1, 0.6, -0.15])
    idle = _lowest_first(np.array([0.0, 5.0]), np.array([1.0, 1.0]), np.array([True, True]))
    assert idle.tolist() == [1.0, 6.0]
    skipped = _lowest_first(release, work, np.array([True, False, True, False]))
    assert skipped[1] == -np.inf and skipped[3] == -np.inf


@pytest.mark.parametrize("clipping", [True, False])
def test_everything_fits_chooses_all_persistent(clipping):
    """fits-b1: at 80 GiB every chunk fits persistent, and the host AdamW of an offloaded
    chunk (0.1 s) is not hidden by the 0.03 s forward: all persistent is the fastest."""
    problem = PlanProblem(llama1b_like(), h200_like(), gpu_budget_bytes=80 * GIB,
                          clipping=clipping)  # fmt: skip
    plan = search(problem).plan
    assert (plan.n_persist, plan.n_swap, plan.n_checkpoint) == (3, 0, 0)
    best = plan.predicted_step_s
    for n_p in range(3):
        ev = problem.evaluate(n_p, 3 - n_p, 0, 0)
        assert ev["step_s"] > best


def test_search_takes_all_persistent_on_a_tie():
    """Synthetic profile, everything fits: wherever no plan is predicted more than
    PLAIN_MARGIN faster than all persistent, the search chooses it."""
    prof = syn.profile(6, 8)
    hw = dataclasses.replace(syn.hardware(), cpu_adam_params_per_s=1e12)
    problem = PlanProblem(prof, hw, gpu_budget_bytes=1 << 50)
    n = problem.memory.n_chunks
    all_persistent = problem.evaluate(n, 0, 0, 0)["step_s"]
    others = [problem.evaluate(n_p, n - n_p, 0, 0)["step_s"] for n_p in range(n)]
    plan = search(problem).plan
    if all_persistent * (1 - PLAIN_MARGIN) <= min(others):
        assert plan.n_persist == n  # also when another plan is a little faster
    else:
        assert plan.predicted_step_s <= min(others) + 1e-12


def test_swap_out_hides_only_under_forward_compute():
    """Swapped activations leave during forward and come back during backward: a phase's
    copies hide under that phase's compute only (not under the whole step's)."""
    profile = llama1b_like()
    rt = RuntimeModel(profile, h200_like())
    hw = rt.hw
    n = rt.n_chunks
    compute = rt.base_compute_s
    fwd = rt.fwd_compute_s
    assert 0 < fwd < compute
    # swap traffic that fits under the whole step's compute but not under the forward's
    swap = int(0.8 * compute * hw.d2h_bytes_per_s)
    t, terms = rt.step_s(n, 0, compute, swap, breakdown=True)
    out_s = max(swap / hw.d2h_bytes_per_s, swap / hw.duplex_bytes_per_s)
    back_s = max(swap / hw.h2d_bytes_per_s, swap / hw.duplex_bytes_per_s)
    bwd = compute - fwd
    expected = max(fwd, out_s) + max(bwd, back_s) + terms["device_optimizer"]
    assert t == pytest.approx(expected)
    assert t > compute + terms["device_optimizer"]  # the forward's swap-out is exposed


def test_host_stall_uses_the_rate_measured_under_copies():
    profile = llama1b_like()
    quiet = RuntimeModel(profile, h200_like())
    busy = RuntimeModel(profile, dataclasses.replace(h200_like(), cpu_adam_busy_params_per_s=2.0e9))
    assert busy.host_adam_rate == 2.0e9 and quiet.host_adam_rate == 4.1e9
    assert busy.host_stall_s[0] > quiet.host_stall_s[0]


def test_clipping_adds_the_host_multiplication_at_its_measured_rate():
    profile = llama1b_like()
    hw = dataclasses.replace(h200_like(), cpu_adam_busy_params_per_s=2.5e9,
                             cpu_clip_params_per_s=8e9)  # fmt: skip
    clip, free = RuntimeModel(profile, hw, clipping=True), RuntimeModel(profile, hw, clipping=False)
    assert clip.host_s_per_param == pytest.approx(1 / 2.5e9 + 1 / 8e9)
    assert free.host_s_per_param == pytest.approx(1 / 2.5e9)
    _, terms = clip.step_s(0, 3, clip.base_compute_s, 0, breakdown=True)
    trn = sum(profile.chunks.trainable_numel)
    assert terms["host_optimizer"] == pytest.approx(trn * clip.host_s_per_param_at[0])
    # the multiplication at its own rate (where nothing is copied the AdamW's is the same;
    # elsewhere the longer host step lowers the link's share: [Note: the host AdamW's rate])
    assert clip.host_s_per_param_at[-1] - free.host_s_per_param_at[-1] == pytest.approx(1 / 8e9)
    # not measured: left out, as before
    unmeasured = RuntimeModel(profile, dataclasses.replace(hw, cpu_clip_params_per_s=None))
    assert unmeasured.host_s_per_param == pytest.approx(1 / 2.5e9)


def test_the_host_adamw_runs_at_the_busy_rate_while_the_link_is_busy():
    """[Note: the host AdamW's rate]: seconds a parameter blend the idle and the busy rate by
    the share of the step the plan's copies keep the link busy."""
    profile = llama1b_like()
    base = dataclasses.replace(h200_like(), cpu_adam_params_per_s=5e9,
                               cpu_adam_busy_params_per_s=2.5e9)  # fmt: skip

    def link(rate):
        return RuntimeModel(profile, dataclasses.replace(
            base, h2d_bytes_per_s=rate, d2h_bytes_per_s=rate, duplex_bytes_per_s=2 * rate
        ), clipping=False).host_s_per_param_at  # fmt: skip

    n = profile.chunks.n_chunks
    fast, slow, mid = link(1e18), link(1e3), RuntimeModel(profile, base, clipping=False)
    assert fast[0] == pytest.approx(1 / 5e9)  # copies take no time: the idle rate
    assert slow[0] == pytest.approx(1 / 2.5e9)  # copies take the whole step: the busy rate
    assert fast[n] == slow[n] == pytest.approx(1 / 5e9)  # nothing offloaded, nothing copied
    spp = mid.host_s_per_param_at
    assert (spp >= 1 / 5e9).all() and (spp <= 1 / 2.5e9).all() and spp[0] > spp[n]
    # by hand at n_persist 0: the share is the link's seconds over the longer of compute and
    # the idle host step
    t = profile.chunks
    trn = np.asarray(t.trainable_numel, dtype=np.float64)
    used = np.asarray(t.used_bytes, dtype=np.float64)
    frozen = used - np.asarray(t.trainable_bytes, dtype=np.float64)
    h2d = (frozen + 4 * trn).sum() + used.sum()
    d2h = np.asarray(t.trainable_bytes, dtype=np.float64).sum() + 4 * trn.sum()
    link_s = max(h2d / base.h2d_bytes_per_s, d2h / base.d2h_bytes_per_s,
                 (h2d + d2h) / base.duplex_bytes_per_s)  # fmt: skip
    share = min(link_s / max(mid.base_compute_s, trn.sum() / 5e9), 1.0)
    assert spp[0] == pytest.approx(share / 2.5e9 + (1 - share) / 5e9)
    # one rate measured (an older profile): that rate
    only = RuntimeModel(profile, dataclasses.replace(base, cpu_adam_busy_params_per_s=None))
    assert only.host_s_per_param_at == pytest.approx(np.full(n + 1, 1 / 5e9))


def test_a_swapped_block_runs_at_the_pace_of_its_copies():
    """A swapped block's forward lasts at least its saved bytes over device-to-host, its
    backward at least the same bytes over host-to-device; on a fast link, only compute."""
    p = llama1b_like()
    n = len(p.blocks)
    keep = np.zeros((1, n), dtype=np.int64)
    swap_first = keep.copy()
    swap_first[0, 0] = SWAP
    saved = p.blocks[0].saved_bytes
    for rate, stall in [(1e18, 0.0), (saved / 0.5, 1.0)]:  # 0.5 s each way on the slow link
        hw = dataclasses.replace(h200_like(), d2h_bytes_per_s=rate, h2d_bytes_per_s=rate)
        rt = RuntimeModel(p, hw)
        (c_keep,), _ = rt.pair_terms(keep)
        (c_swap,), (swapped,) = rt.pair_terms(swap_first)
        assert swapped == saved
        block_fwd, block_bwd = rt.block_fwd_s[0], rt.block_bwd_s[0]
        expect = 0.0 if stall == 0 else (0.5 - block_fwd) + (0.5 - block_bwd)
        assert c_swap - c_keep == pytest.approx(expect)
        (fwd_wait,) = rt.swap_wait_s(swap_first, "forward")
        assert fwd_wait == pytest.approx(0.0 if stall == 0 else 0.5 - block_fwd)
        # the forward wait belongs to the forward: with a copy-bound backward it is not hidden
        _, keep_terms = rt.step_s(3, 0, c_keep, 0, breakdown=True)
        _, swap_terms = rt.step_s(3, 0, c_swap, swapped, fwd_wait, breakdown=True)
        assert swap_terms["compute"] == pytest.approx(keep_terms["compute"] + expect)


def test_the_plan_names_the_swapped_blocks_wait():
    """A plan that swaps on a slow link carries the wait as its own (JSON) term."""
    import json

    hw = dataclasses.replace(h200_like(), d2h_bytes_per_s=1e9, h2d_bytes_per_s=1e9)
    problem = PlanProblem(llama1b_like(), hw, gpu_budget_bytes=80 * GIB)
    terms = problem.evaluate(0, 3, 2, 0)["time_terms"]
    assert terms["swap_wait"] > 0 and json.loads(json.dumps(terms)) == terms
    assert problem.evaluate(0, 3, 0, 2)["time_terms"]["swap_wait"] == 0.0


def test_a_lora_chunk_arrives_after_its_frozen_bytes():
    """LoRA: the last chunk holds 8 M adapter parameters beside ~850 MiB of frozen base
    weights; with clipping its step ends, then the forward's gather copies the base weights
    and the adapters' masters (nothing of the base hides under the tiny update)."""
    p, hw = llama1b_like(), dataclasses.replace(h200_like(), h2d_bytes_per_s=5e9)
    trn = [4 << 20, 4 << 20, 8 << 20]
    p.chunks = dataclasses.replace(
        p.chunks, trainable_numel=trn, trainable_bytes=[2 * n for n in trn],
        max_trainable_numel=[1 << 20] * 3,
    )  # fmt: skip
    rt = RuntimeModel(p, hw, clipping=True)
    frozen = p.chunks.used_bytes[2] - 2 * trn[2]
    tail = 4 * (1 << 20) / hw.d2h_bytes_per_s
    host = trn[2] / hw.cpu_adam_params_per_s
    copy = (frozen + 4 * trn[2]) / hw.h2d_bytes_per_s
    needed = 0.001 + 11 * (0.03 / 16)
    dev_opt = (trn[0] + trn[1]) / hw.device_adam_params_per_s
    assert rt.host_stall_s[2] == pytest.approx(max(tail + host + copy - needed - dev_opt, 0.0))
    assert rt.host_stall_s[2] > 0


def test_one_pass_host_update_moves_compute_dtype_copies_and_no_write_back():
    """On the one-pass path the gathers copy the chunk's bf16 bytes, not fp32 masters,
    nothing is written back, the gradients leave in bf16, and a step moves 32 bytes of host
    memory an offloaded parameter (40 with torch's path and clipping)."""
    profile = llama1b_like()
    hw = dataclasses.replace(h200_like(), cpu_clip_params_per_s=10e9)
    torch_path = RuntimeModel(profile, hw, clipping=True)
    one_pass = RuntimeModel(profile, dataclasses.replace(hw, host_update="one_pass"), clipping=True)
    n, trn = one_pass.n_chunks, profile.chunks.trainable_numel
    assert one_pass.fwd_in[n] == pytest.approx(torch_path.fwd_in[n] - 2 * sum(trn))
    assert one_pass.write_back[n] == 0 and torch_path.write_back[n] == 2 * sum(trn)
    assert one_pass.grads_out[n] == pytest.approx(torch_path.grads_out[n] / 2)
    assert one_pass.host_bytes_per_param(0) == 32
    assert torch_path.host_bytes_per_param(0) == 8 + 24 + 8 + 4 + 2
    # the clip rides in the pass: no separate clip term
    assert one_pass.host_s_per_param < torch_path.host_s_per_param
    _, t1 = one_pass.step_s(0, 2, one_pass.base_compute_s, 0, breakdown=True)
    _, t0 = torch_path.step_s(0, 2, torch_path.base_compute_s, 0, breakdown=True)
    assert t1["h2d_bytes"] < t0["h2d_bytes"] and t1["d2h_bytes"] < t0["d2h_bytes"]


def test_host_floor_is_the_update_bytes_over_the_measured_roof():
    profile = llama1b_like()
    hw = dataclasses.replace(h200_like(), host_update="one_pass", host_memory_bytes_per_s=100e9)
    rt = RuntimeModel(profile, hw, clipping=False)
    params = sum(profile.chunks.trainable_numel)
    assert rt.host_floor_s(0) == pytest.approx(params * 32 / 100e9)
    assert rt.host_floor_s(rt.n_chunks) == 0
    assert RuntimeModel(profile, h200_like()).host_floor_s(0) is None  # not measured
    _, terms = rt.step_s(0, 2, rt.base_compute_s, 0, breakdown=True)
    assert terms["host_floor"] == pytest.approx(params * 32 / 100e9)
    assert terms["host_bytes_per_param"] == 32


@pytest.mark.parametrize("state, expected", [("fp32", 32.0), ("bf16", 24.0), ("8bit", 20.0625)])
def test_host_bytes_follow_the_optimizer_state(state, expected):
    """The compact moments move fewer bytes a step: the master's 8 plus twice the moments'."""
    hw = dataclasses.replace(h200_like(), host_update="one_pass")
    rt = RuntimeModel(llama1b_like(), hw, clipping=False, optimizer_state=state)
    assert rt.host_bytes_per_param(0) == pytest.approx(expected)
