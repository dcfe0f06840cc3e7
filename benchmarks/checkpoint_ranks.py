"""Checkpoint save and load on several CPU ranks (gloo): the sharded format, every rank
writing its own part (`protrain.train.checkpoint.sharded`), against the plain format written
by rank 0 from the gathered state (what several ranks did before).

Wraps a Llama-shaped model on `--world` ranks in the sharded mode with every chunk
offloaded, takes one step, then per rank: seconds and added peak resident memory
(``VmHWM`` after resetting it through ``/proc/self/clear_refs``; Linux) of a gathered plain
save, a sharded save, and the load of each (a plain load reads the whole files on every
rank). One JSON line per rank.

Usage: ``python benchmarks/checkpoint_ranks.py --hidden 512 --layers 8 --world 2``
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import tempfile
import time
from pathlib import Path

_KIB = 1024


def _kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} is not in /proc/self/status")


def _measured(fn):
    before = _kib("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    t0 = time.perf_counter()
    fn()
    return round(time.perf_counter() - t0, 2), round((_kib("VmHWM") - before) * _KIB / 2**30, 3)


def init_gloo(rank: int, world: int, init: str) -> None:
    """This process as `rank` of a gloo group of `world`, one intra-op thread."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=600))  # fmt: skip


def spawn_ranks(rank_fn, args) -> None:
    """`rank_fn(rank, world, args, out, init)` in `args.world` processes, sharing a
    temporary folder `out` and the group's rendezvous file `init`."""
    import torch.multiprocessing as mp

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    with tempfile.TemporaryDirectory() as out:
        init = os.path.join(out, "pg")
        mp.spawn(rank_fn, args=(args.world, args, out, init), nprocs=args.world, join=True)


def _rank(rank: int, world: int, args, out: str, init: str) -> None:
    import torch
    import torch.distributed as dist
    from transformers import LlamaConfig, LlamaForCausalLM

    import protrain
    from protrain.distributed import resolve_context
    from protrain.distributed.dcp_flat import load_pieces
    from protrain.distributed.dcp_state import pieces_to_save, plan_engine_load
    from protrain.train import checkpoint as ckpt
    from protrain.train.checkpoint import sharded
    from protrain.train.ranks import Ranks

    init_gloo(rank, world, init)
    ranks = Ranks(resolve_context())
    torch.manual_seed(0)
    cfg = LlamaConfig(
        hidden_size=args.hidden, intermediate_size=args.hidden * 4,
        num_hidden_layers=args.layers, num_attention_heads=args.hidden // 64,
        num_key_value_heads=args.hidden // 64, vocab_size=args.vocab,
    )  # fmt: skip
    model = LlamaForCausalLM(cfg)
    n_params = sum(p.numel() for p in model.parameters())
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    model, opt, _ = protrain.wrap(model, n_persist=0, device="cpu", lr=1e-4,
                                  distributed_mode="sharded")  # fmt: skip
    ids = torch.randint(0, args.vocab, (1, 64))
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    opt.zero_grad()
    opt.synchronize()
    root = Path(out)

    def gathered_save():
        model_state = protrain.state_dict(model, copy=False, names=names)
        opt_state = opt.state_dict(copy=False)
        if rank == 0:
            ckpt.save_checkpoint(root / "plain", 1, model_state=model_state,
                                 optimizer_state=opt_state, scheduler_state={},
                                 trainer_state={}, save_total_limit=None)  # fmt: skip
        dist.barrier()

    def sharded_save():
        pieces = pieces_to_save(model, opt, names, rank, world)
        sharded.write_sharded(root / "sharded", 1, pieces, {}, ranks, None)

    def plain_load():
        c = ckpt.load_checkpoint(root / "plain" / "checkpoint-1")
        protrain.load_state_dict(model, c.model_state, strict=False)
        opt.load_state_dict(c.optimizer_state)

    def sharded_load():
        load = plan_engine_load(model, opt, names, root / "sharded" / "checkpoint-1")
        load_pieces(load.pieces, root / "sharded" / "checkpoint-1", ranks.ctx.group)
        load.apply()
        dist.barrier()

    row = {"rank": rank, "world": world, "params": n_params, "torch": torch.__version__}
    for what, fn in [("gathered_save", gathered_save), ("sharded_save", sharded_save),
                     ("plain_load", plain_load), ("sharded_load", sharded_load)]:  # fmt: skip
        dist.barrier()
        row[f"{what}_s"], row[f"{what}_added_gib"] = _measured(fn)
    print(json.dumps(row), flush=True)
    protrain.close(model)
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--world", type=int, default=2)
    spawn_ranks(_rank, p.parse_args(argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
