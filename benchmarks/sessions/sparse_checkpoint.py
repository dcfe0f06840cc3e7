"""Session 14 record (issue 25): a checkpoint directory of a workloads.py shape whose
safetensors files have real headers and sparse (unwritten) data, so that `protrain train`'s
host-memory check (train/host_memory.py), which reads headers only, can be seen on a GPU host
for a model the disk could not hold twice. Loading its weights would read zeros: only the
refusal before loading is exercised with it.

Usage: python benchmarks/sessions/sparse_checkpoint.py llama70b /tmp/sparse70b
"""

import json
import math
import shutil
import struct
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from materialize import build_on_meta  # noqa: E402
from protrain.train.modeling import TINY_TOKENIZER_DIR  # noqa: E402
from workloads import hf_config  # noqa: E402

shape, out = sys.argv[1], Path(sys.argv[2])
config = hf_config(shape)
model = build_on_meta(config, torch.bfloat16)
out.mkdir(parents=True, exist_ok=True)
config.save_pretrained(out)
for f in TINY_TOKENIZER_DIR.iterdir():
    shutil.copy(f, out / f.name)
header, offset = {"__metadata__": {"format": "pt"}}, 0
for name, p in model.state_dict().items():
    n = math.prod(p.shape) * 2
    header[name] = {"dtype": "BF16", "shape": list(p.shape), "data_offsets": [offset, offset + n]}
    offset += n
raw = json.dumps(header).encode()
raw += b" " * (-len(raw) % 8)
with open(out / "model.safetensors", "wb") as f:
    f.write(struct.pack("<Q", len(raw)) + raw)
    f.truncate(8 + len(raw) + offset)  # sparse: no data blocks written
print(f"{out}: {offset / 2**30:.1f} GiB of bf16 declared, {sum(1 for _ in header) - 1} tensors")
