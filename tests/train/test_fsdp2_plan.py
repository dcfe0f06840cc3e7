"""`protrain plan` for a config with `fsdp_version: 2`: the FSDP2 engine's peak per rank,
measured from real steps (`train/fsdp2_trace.py`), on the CPU by counting storage bytes.
Two ranks under torchrun: `tests/multirank/test_fsdp2_plan.py`."""

from __future__ import annotations

import re

import torch
from tests.engine.models import build

from protrain.cli import main
from protrain.train.config import validate_config
from protrain.train.fsdp2_trace import StorageBytes, measure_fsdp2_peak

from .helpers import tiny_config, write_config

PEAK = re.compile(r"FSDP2 engine: peak per rank \S+ \((\d+) bytes\)")
FSDP = {"auto_wrap_policy": "TRANSFORMER_BASED_WRAP", "forward_prefetch": True}


def _printed_peak(capsys, config, micro_batch_size: int) -> int:
    assert main(["plan", str(config), "--set", f"micro_batch_size={micro_batch_size}"]) == 0
    out = capsys.readouterr().out
    found = PEAK.findall(out)
    assert len(found) == 1, out
    assert f"of {micro_batch_size} x " in out and "tensor bytes counted on the CPU" in out
    return int(found[0])


def test_plan_prints_a_measured_peak_that_grows_with_the_batch(tmp_path, capsys):
    raw = tiny_config(
        tmp_path, fsdp_version=2, fsdp_config=FSDP, sequence_len=32, gradient_accumulation_steps=1
    )
    config = write_config(tmp_path, raw)
    assert _printed_peak(capsys, config, 4) > _printed_peak(capsys, config, 1)
    assert not (tmp_path / "run").exists()


def test_the_trace_leaves_the_model_as_it_was(tmp_path):
    """The trace shards and trains a copy: the caller's weights keep every bit."""
    cfg = validate_config(tiny_config(tmp_path, fsdp_version=2, fsdp_config=FSDP))
    model = build("llama")
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    ids = torch.randint(1, 95, (2, 16), generator=torch.Generator().manual_seed(0))
    peak = measure_fsdp2_peak(
        model, {"input_ids": ids, "labels": ids.clone()}, cfg, torch.device("cpu"), None
    )
    # at least the fp32 weights, their gradients and AdamW's two moments (one rank: whole)
    assert peak.allocated_bytes > 4 * 4 * sum(p.numel() for p in model.parameters())
    assert peak.reserved_bytes is None
    assert peak.micro_batches == 2 and peak.world_size == 1
    for name, p in model.named_parameters():
        assert type(p) is torch.nn.Parameter, name  # not sharded
        assert torch.equal(p.detach(), before[name]), name


def test_storage_bytes_follow_resizes():
    """FSDP2 frees a gathered unit by resizing its storage to 0 and gathers into it again:
    the count follows both."""
    with StorageBytes() as counter:
        t = torch.empty(1000)  # 4000 bytes
        assert counter.live_bytes == 4000
        t.untyped_storage().resize_(0)
        torch.zeros(1)  # any op: the sizes are read again after it (its 4 bytes are freed)
        assert counter.live_bytes == 0
        t.untyped_storage().resize_(8000)
        torch.zeros(1)
        assert counter.live_bytes == 8000
        del t
        assert counter.live_bytes == 0
    assert counter.peak_bytes == 8004
