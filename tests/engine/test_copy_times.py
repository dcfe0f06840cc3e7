"""The engine's copy counters: per step, the bytes the runtime model predicts (every gather
of an offloaded chunk, its gradients and write-back), the seconds they took, and the
compute's waits for them; and the union of copy intervals that the link's busy time is."""

from __future__ import annotations

import pytest
import torch
from transformers import MistralConfig, MistralForCausalLM

import protrain
from protrain.activations import apply_activation_knobs
from protrain.chunks.copy_times import union_s
from protrain.knobs import Knobs
from protrain.optim import host_adam_ext
from protrain.plan.runtime import RuntimeModel
from protrain.profile.hardware import HardwareProfile
from protrain.profile.trace import trace_model

from .test_gather_traffic import _model, with_lora


def _hardware(device: str) -> HardwareProfile:
    """Rates that do not matter here, and the host update the engine runs on this machine
    (the one pass writes no weights back: plan/runtime.py, [Note: copies of the one-pass
    host update])."""
    return HardwareProfile(
        device=device, device_name="test", h2d_bytes_per_s=1e10, d2h_bytes_per_s=1e10,
        duplex_bytes_per_s=1e10, cpu_adam_params_per_s=1e9, device_adam_params_per_s=1e9,
        collective_bytes_per_s=None, cpu_threads=1,
        host_update="torch" if host_adam_ext.kernel() is None else "one_pass",
    )  # fmt: skip


def _mistral(mode: str, tied: bool = False) -> torch.nn.Module:
    """Mistral-7B's shape scaled down (hidden 64: k, v a quarter of q; the MLP 3.5 x q);
    untied head unless ``tied``. With chunks of 2.29 MLP projections (256 MiB at Mistral-7B in bf16) each
    block lies over two chunks, its attention and gate in one and up, down and its norms,
    which it runs first, in the next: the block uses its chunks out of order."""
    torch.manual_seed(0)
    cfg = MistralConfig(
        vocab_size=500, hidden_size=64, intermediate_size=224, num_hidden_layers=8,
        num_attention_heads=4, num_key_value_heads=1, max_position_embeddings=64,
        tie_word_embeddings=tied,
    )  # fmt: skip
    return with_lora(MistralForCausalLM(cfg), mode, r=2)


def _llama_chunk(dtype: torch.dtype) -> int:
    """About 2.3 blocks of the Llama LoRA model a chunk (as in test_gather_traffic): blocks
    straddle chunks."""
    block = _model("lora").get_base_model().model.layers[0]
    size = torch.finfo(dtype).bits // 8
    return (int(2.3 * sum(p.numel() * size for p in block.parameters())) + 63) // 64 * 64


def _mistral_chunk(dtype: torch.dtype) -> int:
    return int(2.2857 * 224 * 64 * (torch.finfo(dtype).bits // 8)) // 64 * 64


# (model, chunk size for a compute dtype, n_persist, n_buffer, n_checkpoint)
_PLANS = {
    "llama-lora": (lambda: _model("lora"), _llama_chunk, 2, 3, 0),
    # the held-out Mistral-7B LoRA row at 48 GiB: every chunk offloaded, three buffers, the
    # first blocks checkpointed; the embedding alone in the first chunk, which backward
    # never gathers
    "mistral-lora": (lambda: _mistral("lora"), _mistral_chunk, 0, 3, 4),
    # full fine-tuning: the forward after an update gathers fp32 masters
    "mistral-full": (lambda: _mistral("full"), _mistral_chunk, 1, 2, 8),
    # Tied heads, chunk 0 (the embedding's, which the head shares) offloaded: [Note: a
    # tied head] in plan/runtime.py. Blocks over two chunks: with 3 buffers the head's chunk
    # is evicted in forward and gathered again, with 4 it stays.
    "tied-llama-lora-3": (lambda: _model("lora", tied=True), _llama_chunk, 0, 3, 0),
    "tied-llama-full-3": (lambda: _model("full", tied=True), _llama_chunk, 0, 3, 12),
    "tied-llama-lora-4": (lambda: _model("lora", tied=True), _llama_chunk, 0, 4, 0),
    "tied-llama-full-4": (lambda: _model("full", tied=True), _llama_chunk, 0, 4, 0),
    # the embedding alone in chunk 0, frozen: backward uses it for the head only
    "tied-mistral-lora-3": (lambda: _mistral("lora", tied=True), _mistral_chunk, 0, 3, 4),
}

_TIED = [k for k in _PLANS if k.startswith("tied-")]


@pytest.mark.parametrize(
    ("device", "dtype", "plan"),
    [
        pytest.param("cpu", torch.float32, "llama-lora", id="cpu-fp32-llama-lora"),
        pytest.param("cpu", torch.bfloat16, "llama-lora", id="cpu-bf16-llama-lora"),
        pytest.param("cpu", torch.bfloat16, "mistral-lora", id="cpu-bf16-mistral-lora"),
        pytest.param("cpu", torch.bfloat16, "mistral-full", id="cpu-bf16-mistral-full"),
        *(pytest.param("cpu", torch.bfloat16, k, id=f"cpu-bf16-{k}") for k in _TIED),
        pytest.param(
            "cuda", torch.bfloat16, "llama-lora", marks=pytest.mark.gpu, id="cuda-bf16-llama-lora"
        ),
        pytest.param(
            "cuda",
            torch.bfloat16,
            "mistral-lora",
            marks=pytest.mark.gpu,
            id="cuda-bf16-mistral-lora",
        ),
    ],
)
def test_counters_count_the_bytes_the_plan_predicts(device, dtype, plan):
    """After an update, the forward copies each offloaded chunk's frozen bytes as they are
    and its trainable parameters (torch's path: their fp32 masters, writing back only the
    trainable bytes; the one pass: the host copy it wrote, nothing written back);
    backward gathers each chunk it uses once more, except those resident at the turn. The
    counted bytes equal the runtime model's, also where blocks use their chunks out of
    order (the Mistral plans; before the engine prefetched by recorded use, 52 gathers a
    step where 32 suffice) and in bf16."""
    build, chunk_of_dtype, n_persist, n_buffer, n_checkpoint = _PLANS[plan]
    ids = torch.randint(96, (2, 32), generator=torch.Generator().manual_seed(0)).to(device)
    batch = {"input_ids": ids, "labels": ids}
    chunk = chunk_of_dtype(dtype)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny models run faster on one intra-op thread
    try:
        profile = trace_model(
            build(), batch, device=device, compute_dtype=dtype,
            knobs=Knobs(n_persist=n_persist, chunk_size_bytes=chunk),
        )  # fmt: skip
        runtime = RuntimeModel(profile, _hardware(device))
        n_off = runtime.n_chunks - n_persist
        assert n_off > n_buffer  # backward gathers again what is no longer resident
        assert profile.head_after_blocks
        tied = plan in _TIED
        assert profile.chunks.tied_head_chunk == (0 if tied else None)
        _, terms = runtime.step_s(n_persist, n_buffer, 1.0, 0, breakdown=True)
        gathers = int(runtime.forward_gathers(n_persist, n_buffer))
        gathers += int(runtime.backward_gathers(n_persist, n_buffer))

        model, opt, layout = protrain.wrap(
            build(), n_persist=n_persist, n_buffer=n_buffer, device=device,
            chunk_size_bytes=chunk, compute_dtype=dtype, lr=1e-3,
        )  # fmt: skip
        handle = apply_activation_knobs(model, 0, n_checkpoint, device=device)
        assert layout.n_chunks == runtime.n_chunks
        manager = model._protrain_engine.manager
        for step in range(3):
            manager.settle_counters()
            before = dict(opt.stats)
            model(**batch, use_cache=False).loss.backward()
            opt.step()
            opt.zero_grad()
            opt.synchronize()
            manager.settle_counters()
            d = {k: opt.stats[k] - before[k] for k in before}
            if step == 0:
                continue  # the first step records the order of use, and no update came before
            assert d["gathers"] == gathers
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
        handle.remove()
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
