"""Host memory a checkpoint save adds while the engine's own memory is live.

A save writes the model states (fp32 masters) and the optimizer's (the host AdamW's
moments). Copied into state dicts first, they took a second 12 bytes a trainable parameter
of host memory for the length of the save (full-8b: about 96 GB, beside the engine's ~112);
the save now writes views of the engine's own tensors (``protrain.state_dict(copy=False)``,
``optimizer.state_dict(copy=False)``). This wraps a Llama-shaped model on the CPU with every
chunk offloaded, takes one step, then saves a checkpoint both ways, each in a fresh process,
and reads the process's peak resident memory over the save (``VmHWM`` after resetting it
through ``/proc/self/clear_refs``; Linux). One JSON line per way.

Usage: ``python benchmarks/checkpoint_memory.py --hidden 1024 --layers 8 --out r.jsonl``
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

_KIB = 1024


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} is not in /proc/self/status")


def _child(args) -> dict:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    import protrain
    from protrain.train import checkpoint as ckpt

    torch.manual_seed(0)
    cfg = LlamaConfig(
        hidden_size=args.hidden, intermediate_size=args.hidden * 4,
        num_hidden_layers=args.layers, num_attention_heads=args.hidden // 64,
        num_key_value_heads=args.hidden // 64, vocab_size=args.vocab,
    )  # fmt: skip
    model = LlamaForCausalLM(cfg)
    n_params = sum(p.numel() for p in model.parameters())
    model, opt, _ = protrain.wrap(model, n_persist=0, device="cpu", lr=1e-4)
    ids = torch.randint(0, args.vocab, (1, 64))
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    opt.zero_grad()
    opt.synchronize()
    copy = args.way == "copies"
    with tempfile.TemporaryDirectory() as out:
        before = _status_kib("VmRSS")
        Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
        t0 = time.perf_counter()
        ckpt.save_checkpoint(
            Path(out),
            1,
            model_state=protrain.state_dict(model, copy=copy),
            optimizer_state=opt.state_dict(copy=copy),
            scheduler_state={},
            trainer_state={},
            save_total_limit=None,
        )
        seconds = time.perf_counter() - t0
        peak = _status_kib("VmHWM")
    protrain.close(model)
    return {
        "way": args.way,
        "params": n_params,
        "rss_before_gib": round(before * _KIB / 2**30, 3),
        "save_added_gib": round((peak - before) * _KIB / 2**30, 3),
        "added_bytes_per_param": round((peak - before) * _KIB / n_params, 2),
        "save_s": round(seconds, 2),
        "torch": torch.__version__,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--out", type=Path)
    p.add_argument("--way", choices=["copies", "views"], help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.way:  # the child: one way, one process
        print(json.dumps(_child(args)))
        return 0
    rows = []
    for way in ("copies", "views"):
        cmd = [sys.executable, __file__, "--way", way, "--hidden", str(args.hidden),
               "--layers", str(args.layers), "--vocab", str(args.vocab)]  # fmt: skip
        proc = subprocess.run(cmd, capture_output=True, text=True, check=True)
        row = json.loads(proc.stdout.strip().splitlines()[-1])
        rows.append(row)
        print(json.dumps(row), flush=True)
    if args.out:
        from report import append  # benchmarks/ is this script's folder

        append(args.out, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
