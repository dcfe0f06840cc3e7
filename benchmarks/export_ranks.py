"""The final export of a run on several CPU ranks (gloo): streamed one tensor at a time
(`protrain.train.checkpoint.streamed_export`, what `protrain train` does on several ranks) against
the export gathered before it (the engine closed on every rank, which puts the whole model
back together on each, then rank 0's `save_pretrained`).

A random Llama of the given shape, trained one step on `--world` ranks by the chunk engine
(`--engine sharded` or `replicated`, every chunk offloaded) or the FSDP2 engine
(`--engine fsdp2`), then per rank: seconds and added peak resident memory (``VmHWM``
after resetting it through ``/proc/self/clear_refs``, as `checkpoint_ranks.py` measures;
Linux) of the streamed export, then of the gathered one, and whether the two wrote the same
bytes. One JSON line per rank.

Usage: ``python benchmarks/export_ranks.py --hidden 640 --layers 8 --world 2``
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from checkpoint_ranks import _measured, init_gloo, spawn_ranks  # noqa: E402


def _rank(rank: int, world: int, args, out: str, init: str) -> None:
    import torch
    import torch.distributed as dist
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from protrain.distributed import resolve_context
    from protrain.train.checkpoint.streamed_export import export_streamed
    from protrain.train.config import QUICKSTART_DIR, validate_config
    from protrain.train.modeling import TINY_TOKENIZER_DIR
    from protrain.train.ranks import Ranks

    init_gloo(rank, world, init)
    ranks = Ranks(resolve_context())
    raw = {
        "model": {"name_or_path": "tiny"},
        "datasets": [{"path": str(QUICKSTART_DIR / "data" / "chat.jsonl"), "type": "chat"}],
        "output_dir": out,
    }
    if args.engine == "fsdp2":
        raw.update(fsdp_version=2, fsdp_config={"auto_wrap_policy": "TRANSFORMER_BASED_WRAP"})
    else:
        raw["memory"] = {"n_persist": 0, "mode": args.engine}
    cfg = validate_config(raw)
    torch.manual_seed(0)
    model = LlamaForCausalLM(
        LlamaConfig(
            hidden_size=args.hidden, intermediate_size=args.hidden * 4,
            num_hidden_layers=args.layers, num_attention_heads=args.hidden // 64,
            num_key_value_heads=args.hidden // 64, vocab_size=args.vocab,
        )
    )  # fmt: skip
    n_params = sum(p.numel() for p in model.parameters())
    device = torch.device("cpu")
    if args.engine == "fsdp2":
        from protrain.train.fsdp2_trainable import FSDP2Trainable

        trainable = FSDP2Trainable(model, cfg, device, None)
    else:
        from protrain.train.trainable import EngineTrainable

        trainable = EngineTrainable(model, cfg, device, None, several_ranks=True)
    del model
    ids = torch.randint(0, args.vocab, (1, 64))
    loss = trainable.forward_loss_sum({"input_ids": ids, "labels": ids})
    trainable.backward(loss / ids.numel(), last=True)
    trainable.clip_grad_norm(1.0)
    trainable.optimizer_step()
    # the chunk engine's host AdamW runs on after the step (and creates its moments): done
    # before anything is measured
    getattr(trainable.optimizer, "synchronize", lambda: None)()
    tokenizer = AutoTokenizer.from_pretrained(TINY_TOKENIZER_DIR)
    root = Path(out)

    def streamed() -> None:
        export_streamed(trainable, tokenizer, root / "streamed", ranks)
        ranks.barrier()

    def gathered() -> None:
        model = trainable.export_model()  # every rank: closing gathers in the sharded mode
        if ranks.is_main:
            model.save_pretrained(root / "gathered", safe_serialization=True)
            tokenizer.save_pretrained(root / "gathered")
        ranks.barrier()

    row = {"rank": rank, "world": world, "engine": args.engine, "params": n_params,
           "torch": torch.__version__}  # fmt: skip
    for what, fn in [("streamed_export", streamed), ("gathered_export", gathered)]:
        ranks.barrier()
        row[f"{what}_s"], row[f"{what}_added_gib"] = _measured(fn)
    if ranks.is_main:
        files = sorted(p.name for p in (root / "gathered").iterdir())
        row["same_bytes"] = files == sorted(p.name for p in (root / "streamed").iterdir()) and all(
            (root / "streamed" / f).read_bytes() == (root / "gathered" / f).read_bytes()
            for f in files
        )
    print(json.dumps(row), flush=True)
    trainable.close()
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--hidden", type=int, default=640)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--engine", choices=["sharded", "replicated", "fsdp2"], default="sharded")
    spawn_ranks(_rank, p.parse_args(argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
