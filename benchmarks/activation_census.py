"""Where a step's activation memory goes, op by op, at the step's peak (CPU, no GPU needed).

Two Llama-3-8B-shaped decoder layers (vocabulary 256, so that embedding and logits are
small), LoRA r=16 on every linear, bf16, through ``protrain.wrap`` on the CPU with every
block offload-checkpointed and the MLP tiled (``--tile`` tokens). A ``TorchDispatchMode``
books every new storage an op returns (dtype, shape, op) and frees it with the storage; at
the step's peak the live storages are grouped by (op, dtype, shape) and printed per token.
``--no-norm-tiling`` leaves the norms whole (the tiled-MLP knob tiles them).
On the CPU the host copies of offloaded block inputs are counted too (the ``uint8`` rows);
on a GPU they are host memory.

    python benchmarks/activation_census.py --tokens 4096 [--no-norm-tiling] [--out FILE]
"""

from __future__ import annotations

import argparse
import collections
import json
import time
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class Census(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.live: dict[int, tuple] = {}
        self.bytes = self.peak = 0
        self.at_peak: tuple[str, dict] | None = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {
            a.untyped_storage().data_ptr()
            for a in tree_leaves((args, kwargs))
            if isinstance(a, torch.Tensor)
        }
        for t in tree_leaves(out):
            if not isinstance(t, torch.Tensor):
                continue
            st = t.untyped_storage()
            if st.data_ptr() in inputs or id(st) in self.live:
                continue
            nbytes = st.nbytes()
            self.live[id(st)] = (func.__name__, str(t.dtype), tuple(t.shape), nbytes)
            self.bytes += nbytes
            weakref.finalize(st, self._free, id(st), nbytes)
        if self.bytes > self.peak:
            self.peak, self.at_peak = self.bytes, (func.__name__, dict(self.live))
        return out

    def _free(self, key: int, nbytes: int) -> None:
        if self.live.pop(key, None) is not None:
            self.bytes -= nbytes


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--tile", type=int, default=256)
    p.add_argument("--no-norm-tiling", action="store_true")
    p.add_argument("--out", help="append the result as one JSON line")
    args = p.parse_args()

    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    import protrain
    import protrain.activations.tiled_mlp as tiled
    from protrain.activations import apply_activation_knobs

    if args.no_norm_tiling:
        tiled.block_norms = lambda module: []
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=4096, intermediate_size=14336, num_attention_heads=32,
                      num_key_value_heads=8, num_hidden_layers=2, vocab_size=256,
                      max_position_embeddings=1 << 20, use_cache=False)  # fmt: skip
    cfg._attn_implementation = "sdpa"
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    model = model.to_empty(device="cpu").to(torch.bfloat16)
    for w in model.parameters():
        torch.nn.init.normal_(w, std=0.02)
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    model = get_peft_model(model, LoraConfig(r=16, target_modules=targets, lora_dropout=0.0))
    model, _, _ = protrain.wrap(model, device="cpu", lr=1e-4, compute_dtype=torch.bfloat16)
    apply_activation_knobs(model, 0, 2, device="cpu", offload_checkpoint_inputs=True,
                           tiled_mlp_tokens=args.tile)  # fmt: skip
    ids = torch.randint(256, (1, args.tokens))
    census = Census()
    t0 = time.perf_counter()
    with census:
        model(input_ids=ids, labels=ids).loss.backward()
    op, live = census.at_peak
    groups: collections.Counter = collections.Counter()
    for name, dtype, shape, nbytes in live.values():
        groups[(name, dtype, shape)] += nbytes
    per_token = census.peak / args.tokens / 1024
    host = sum(n for (_, dtype, _), n in groups.items() if dtype == "torch.uint8")
    row = {
        "tokens": args.tokens, "tile": args.tile, "norm_tiling": not args.no_norm_tiling,
        "peak_kib_per_token": round(per_token, 1),
        "peak_kib_per_token_without_host_copies": round((census.peak - host) / args.tokens / 1024, 1),
        "peak_op": op, "seconds": round(time.perf_counter() - t0, 1),
        "at_peak": [
            {"op": n, "dtype": d, "shape": list(s), "kib_per_token": round(b / args.tokens / 1024, 2)}
            for (n, d, s), b in groups.most_common(12)
        ],
    }  # fmt: skip
    print(json.dumps(row))
    if args.out:
        with open(args.out, "a") as f:
            f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
