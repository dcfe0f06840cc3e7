"""`SafetensorsStreamWriter` (the streamed export's file writer): tensors of several dtypes,
a scalar and an empty one written one at a time give the bytes of
`safetensors.torch.save_file`; a tensor out of order or of another shape is refused."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from protrain.train.checkpoint.streamed_export import SafetensorsStreamWriter


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "model.layers.1.w": torch.randn(3, 5, generator=g),
        "model.layers.10.w": torch.randn(7, generator=g).to(torch.bfloat16),
        "b.scale": torch.tensor(2.5),
        "a.half": torch.randn(2, 2, generator=g).to(torch.float16),
        "count": torch.arange(4, dtype=torch.int64),
        "mask": torch.tensor([True, False, True]),
        "empty": torch.zeros(0, 4),
        "codes": torch.arange(9, dtype=torch.uint8),
    }


def test_streamed_file_is_save_files(tmp_path):
    tensors = _tensors()
    save_file(tensors, tmp_path / "want.safetensors", metadata={"format": "pt"})
    meta = {k: torch.empty_like(v, device="meta") for k, v in tensors.items()}
    writer = SafetensorsStreamWriter(tmp_path / "got.safetensors", meta, {"format": "pt"})
    for name in writer.order:
        writer.write(name, tensors[name])
    writer.close()
    assert (tmp_path / "got.safetensors").read_bytes() == (
        tmp_path / "want.safetensors"
    ).read_bytes()


def test_refusals(tmp_path):
    tensors = _tensors()
    meta = {k: torch.empty_like(v, device="meta") for k, v in tensors.items()}
    writer = SafetensorsStreamWriter(tmp_path / "x.safetensors", meta, {"format": "pt"})
    with pytest.raises(ValueError, match="out of order"):
        writer.write(writer.order[1], tensors[writer.order[1]])
    first = writer.order[0]
    with pytest.raises(ValueError, match="its header says"):
        writer.write(first, torch.zeros(1, dtype=tensors[first].dtype))
    with pytest.raises(RuntimeError, match="tensors unwritten"):
        writer.close()
