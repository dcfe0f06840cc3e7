"""Every byte the chunk engine moves over the host-device link in a step, per rank, on gloo
ranks in the sharded mode (bf16 compute on the CPU, where the copies are host-to-host and
counted by the same counters as on CUDA).

Per rank and step, with ``S`` the rank's shard of a chunk's span (the whole chunk on one
rank; ``chunks/shard.py``):

- a gather after a host update: the frozen bytes of ``S`` as they are, and 4 bytes a
  trainable element of ``S`` (its fp32 master, cast on the device); the write-back then
  copies the trainable bytes of ``S`` back (device-to-host);
- any other gather: the parameter bytes of ``S`` (not the alignment padding past the
  chunk's last parameter, which nothing reads);
- the gradients: 4 bytes a trainable element of ``S`` (the reduced shard, cast to fp32 on
  the device) in the first backward of a step, the compute dtype's bytes in each later one
  (gradient accumulation: added into the fp32 accumulator on the host).

The per-rank counts equal that sum exactly, and over the ranks they equal what one process
moves with the same layout (``tests/engine/test_copy_times.py`` pins the one-process counts
to the runtime model's). The chunks here end in a third of padding: split over the whole
chunk, their last shard at 3 ranks would hold no parameter and rank 0 would move the most;
split over the span, full fine-tuning's ranks move the same bytes but for the alignment.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from tests.engine.models import batches, lora
from transformers import LlamaConfig, LlamaForCausalLM

import protrain
from protrain.chunks.shard import ShardRange, shard_multiple
from protrain.optim import host_adam_ext

from .ranks import run_ranks

STEPS = 3  # the first records the order of use; no update comes before it
# a multiple of 64 * 2 and 64 * 3 that holds one MLP projection of _model() in bf16 (16 KiB)
# and not two: those chunks end in 8 KiB of padding, the whole last shard at 3 ranks
CHUNK = 64 * 6 * 64


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=224, hidden_size=32, intermediate_size=256, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        tie_word_embeddings=False,
    )  # fmt: skip
    return LlamaForCausalLM(cfg)


def _run(adapter: bool, distributed: bool, accum: int) -> list[tuple[int, int, list]]:
    """Per step (``accum`` micro-batches) after the first: (h2d bytes, d2h bytes, the gathers
    as (chunk, after an update)); each step asserts the bytes against the module doc's sum."""
    model = _model()
    model, opt, _ = protrain.wrap(
        lora(model, "llama") if adapter else model,
        device="cpu",
        n_persist=1,
        n_buffer=4 if adapter else 2,  # a LoRA block holds its (up to 4) chunks together
        lr=1e-2,
        chunk_size_bytes=CHUNK,
        compute_dtype=torch.bfloat16,
        distributed_mode="sharded" if distributed else None,
        grad_reduce="sum",
    )
    manager = model._protrain_engine.manager
    gathers: list[tuple[int, bool]] = []
    copy_in = manager._copy_in_or_release

    def spy(c):
        gathers.append((c.index, c.host_stale))
        copy_in(c)

    manager._copy_in_or_release = spy
    data = batches("llama", STEPS * accum)
    out = []
    for step in range(STEPS):
        before = dict(opt.stats)
        gathers.clear()
        for mb in range(accum):
            model(**data[step * accum + mb]).loss.backward()
        opt.step()
        opt.zero_grad()
        opt.synchronize()
        manager.settle_counters()
        if step == 0:
            continue
        h2d = opt.stats["h2d_bytes"] - before["h2d_bytes"]
        d2h = opt.stats["d2h_bytes"] - before["d2h_bytes"]
        assert (h2d, d2h) == _expected(manager, gathers, accum), (step, gathers)
        out.append((h2d, d2h, list(gathers)))
    protrain.close(model)
    return out


def _expected(manager, gathers: list[tuple[int, bool]], accum: int) -> tuple[int, int]:
    """The module doc's sum over this step's gathers and gradients."""
    h2d = d2h = 0
    one_pass = host_adam_ext.kernel() is not None  # it writes the host copy: no cast, no write-back
    for ci, after_update in gathers:
        c = manager.chunks[ci]
        sh = c.shard or ShardRange(0, c.nbytes)
        if after_update and not one_pass:
            h2d += sum(b - a for a, b in sh.clip_runs(c.byte_runs(trainable=False)))
            h2d += sum(4 * s.master.numel() for s in c.trainable_slots)
            d2h += sum(b - a for a, b in sh.clip_runs(c.byte_runs(trainable=True)))
        else:
            h2d += max(0, min(sh.end, c.used_bytes) - sh.start)
    for s in (s for c in manager.offloaded for s in c.trainable_slots):
        # the first micro-batch's gradient: in fp32, or, for the one pass of a run that
        # never accumulates, as it is ([Note: gradients for the one pass])
        low = s.placement.dtype.itemsize
        first = low if one_pass and accum == 1 else 4
        d2h += s.master.numel() * (first + (accum - 1) * low)
    return h2d, d2h


def _check_ranks(rank: int, world: int, adapter: bool, accum: int, single: list) -> None:
    steps = _run(adapter, distributed=True, accum=accum)
    assert len(steps) == len(single)
    for (h2d, d2h, gathers), (h2d_1, d2h_1, gathers_1) in zip(steps, single):
        assert gathers == gathers_1  # the same gathers as one process, in its order
        total = torch.tensor([h2d, d2h], dtype=torch.int64)
        dist.all_reduce(total)
        assert total.tolist() == [h2d_1, d2h_1], (rank, total.tolist(), (h2d_1, d2h_1))
        if not adapter:  # every byte trainable: the ranks' shares differ by the alignment
            every = [torch.zeros(2, dtype=torch.int64) for _ in range(world)]
            dist.all_gather(every, torch.tensor([h2d, d2h], dtype=torch.int64))
            spread = torch.stack(every).max(0).values - torch.stack(every).min(0).values
            # fp32 masters: up to 2x the bytes of a padding run, one a chunk gathered
            bound = len(gathers) * 2 * shard_multiple(world)
            assert spread.max() < bound, (rank, every, bound)


@pytest.mark.parametrize(
    ("world", "adapter", "accum"),
    [(2, False, 1), (2, True, 1), (3, False, 1), (2, False, 2), (2, True, 2)],
    ids=["2-full", "2-lora", "3-full", "2-full-accum2", "2-lora-accum2"],
)
def test_link_bytes_per_rank_are_the_shards_of_one_process(world, adapter, accum):
    single = _run(adapter, distributed=False, accum=accum)
    # chunks ending in padding gathered in backward (not after an update); at 3 ranks a
    # third of them or more, the last shard of the whole chunk
    model, _, layout = protrain.wrap(_model(), device="cpu", n_persist=1, n_buffer=2,
                                     chunk_size_bytes=CHUNK, compute_dtype=torch.bfloat16)  # fmt: skip
    used = {spec.index: max(pl.offset_bytes + pl.nbytes for pl in spec.placements)
            for spec in layout.chunks}  # fmt: skip
    protrain.close(model)
    again = {ci for _, _, gathers in single for ci, after in gathers if not after}
    last_shard = CHUNK - CHUNK // world
    assert any(used[ci] <= (last_shard if world == 3 else CHUNK - 1) for ci in again)
    run_ranks(world, _check_ranks, adapter, accum, single, check_group_freed=True)
