"""The engine's copy counters: per step, the bytes the runtime model predicts (every gather
of an offloaded chunk, its gradients and write-back), the seconds they took, and the
compute's waits for them; and the union of copy intervals that the link's busy time is."""

from __future__ import annotations

import pytest
import torch

import protrain
from protrain.chunks.copy_times import union_s
from protrain.plan.runtime import RuntimeModel
from protrain.profile.hardware import HardwareProfile
from protrain.profile.trace import trace_model

from .test_gather_traffic import _model

N_PERSIST, N_BUFFER = 2, 3


def _hardware(device: str) -> HardwareProfile:
    return HardwareProfile(
        device=device, device_name="test", h2d_bytes_per_s=1e10, d2h_bytes_per_s=1e10,
        duplex_bytes_per_s=1e10, cpu_adam_params_per_s=1e9, device_adam_params_per_s=1e9,
        collective_bytes_per_s=None, cpu_threads=1,
    )  # fmt: skip


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_counters_count_the_bytes_the_plan_predicts(device):
    """A LoRA model: the forward after an update copies the frozen base as it is and the
    adapters' fp32 masters, and writes back only the adapters."""
    ids = torch.randint(128, (2, 32), generator=torch.Generator().manual_seed(0)).to(device)
    batch = {"input_ids": ids, "labels": ids}
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    block = _model("lora").get_base_model().model.layers[0]
    # about 2.3 blocks a chunk (as in test_gather_traffic): blocks straddle chunks; chunks
    # hold the compute dtype (bf16 on CUDA: at 4 bytes a parameter the model fit 3 chunks)
    size = torch.finfo(dtype).bits // 8
    chunk = (int(2.3 * sum(p.numel() * size for p in block.parameters())) + 63) // 64 * 64
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny models run faster on one intra-op thread
    try:
        profile = trace_model(
            _model("lora"), batch, device=device, compute_dtype=dtype, n_persist=N_PERSIST,
            chunk_size_bytes=chunk,
        )  # fmt: skip
        runtime = RuntimeModel(profile, _hardware(device))
        n_off = runtime.n_chunks - N_PERSIST
        assert n_off > N_BUFFER  # backward gathers again what is no longer resident
        _, terms = runtime.step_s(N_PERSIST, N_BUFFER, 1.0, 0, breakdown=True)

        model, opt, layout = protrain.wrap(
            _model("lora"), n_persist=N_PERSIST, n_buffer=N_BUFFER, device=device,
            chunk_size_bytes=chunk, compute_dtype=dtype, lr=1e-3,
        )  # fmt: skip
        assert layout.n_chunks == runtime.n_chunks
        manager = model._protrain_engine.manager
        for step in range(3):
            manager.settle_counters()
            before = dict(opt.stats)
            model(**batch).loss.backward()
            opt.step()
            opt.zero_grad()
            opt.synchronize()
            manager.settle_counters()
            d = {k: opt.stats[k] - before[k] for k in before}
            if step == 0:
                continue  # the first forward records the order, and no update came before
            # after an update: forward gathers the fp32 masters of every offloaded chunk and
            # writes the updated parameters back; backward gathers again all but the
            # n_buffer resident at the turn and sends every offloaded gradient out in fp32
            assert d["gathers"] == 2 * n_off - N_BUFFER
            assert d["h2d_bytes"] == terms["h2d_bytes"]
            assert d["d2h_bytes"] == terms["d2h_bytes"]
            assert d["h2d_s"] > 0 and d["d2h_s"] > 0
            assert max(d["h2d_s"], d["d2h_s"]) <= d["copy_busy_s"]
            assert d["copy_busy_s"] <= d["h2d_s"] + d["d2h_s"] + 1e-9
            if device == "cpu":  # one thread: copies take turns, and compute waits for each
                assert d["copy_busy_s"] == pytest.approx(d["h2d_s"] + d["d2h_s"])
                assert d["wait_copy_s"] == pytest.approx(d["copy_busy_s"])
            else:
                assert 0 <= d["wait_copy_s"] < d["copy_busy_s"] + 1.0
        protrain.close(model)
    finally:
        torch.set_num_threads(threads)


def test_busy_time_is_the_union_of_the_copy_intervals():
    assert union_s([]) == 0.0
    # two directions overlapping by 1 s, a gap, one nested interval, one touching
    intervals = [(0.0, 2.0), (1.0, 3.0), (5.0, 6.0), (5.2, 5.8), (6.0, 6.5)]
    assert union_s(intervals) == pytest.approx(3.0 + 1.5)
    assert union_s(list(reversed(intervals))) == pytest.approx(4.5)


class _Event:
    """A stand-in for a completed (or pending) CUDA timing event at ``t`` seconds."""

    def __init__(self, t: float) -> None:
        self.t, self.done = t, True

    def query(self) -> bool:
        return self.done

    def elapsed_time(self, end: _Event) -> float:
        return (end.t - self.t) * 1e3


class _Stream:
    """Records stand-in events at the given times, in order."""

    def __init__(self, *times: float) -> None:
        self.events = [_Event(t) for t in times]
        self._next = iter(self.events)

    def record_event(self, event=None) -> _Event:
        return next(self._next)

    def wait_event(self, event) -> None:
        pass


def test_cuda_records_are_counted_once_all_have_completed(monkeypatch):
    """The CUDA bookkeeping, with stand-in events: nothing is read while a record is
    pending; then each direction's seconds, their union and the compute's waits; the next
    records are read against the last counted one."""
    from protrain.chunks import copy_times as ct

    monkeypatch.setattr(ct, "_timing_event", lambda: None)
    stats: dict = {}
    times = ct.CopyTimes(torch.device("cpu"), stats)
    times.is_cuda, times._anchor = True, _Event(0.0)  # as construction on CUDA leaves it
    h2d, d2h, compute = _Stream(1.0, 3.0, 6.0, 7.0), _Stream(2.0, 5.0), _Stream(2.5, 3.0)
    with times.span(ct.H2D, h2d) as span:
        span.add(100)
        span.add(50)
    with times.span(ct.D2H, d2h) as span:
        span.add(30)
    times.wait(compute, event=None)
    d2h.events[-1].done = False  # still copying
    times.harvest()
    assert stats["h2d_bytes"] == 0 and stats["copy_busy_s"] == 0.0
    d2h.events[-1].done = True
    times.harvest()
    assert (stats["h2d_bytes"], stats["d2h_bytes"]) == (150, 30)
    assert (stats["h2d_s"], stats["d2h_s"]) == (pytest.approx(2.0), pytest.approx(3.0))
    assert stats["copy_busy_s"] == pytest.approx(4.0)  # [1, 3] and [2, 5] overlap
    assert stats["wait_copy_s"] == pytest.approx(0.5)
    with times.span(ct.H2D, h2d) as span:  # after the count: anchored at its last end
        span.add(10)
    times.harvest()
    assert stats["h2d_s"] == pytest.approx(3.0) and stats["copy_busy_s"] == pytest.approx(5.0)
