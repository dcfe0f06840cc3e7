"""The final export of a run on several ranks, written one tensor at a time.

Full fine-tuning: Hugging Face safetensors files, split into files as `save_pretrained`
splits them (`split_torch_state_dict_into_shards` at its default 50GB, with
`model.safetensors.index.json` when there are several), the names and dtypes it would
write (tied weights and `_keys_to_ignore_on_save` left out by transformers' own rule), the
config and generation config. Each file is laid out as `safetensors.torch.save_file` lays
it out (see `SafetensorsStreamWriter`), its header written first from shapes and dtypes
alone; then every tensor is gathered (`Trainable.full_tensor`: one parameter's elements,
a collective of the engine's sharded chunks or of FSDP2's DTensors), rank 0 writes it at
its place and drops it. No rank ever holds more than one whole tensor beyond its own share.

LoRA: only the trainable tensors (the trained adapters) are gathered, never the base model
nor frozen adapters, and peft writes the adapter directories from them
(`save_pretrained(state_dict=..., selected_adapters=...)`).

A model whose saved names are not its parameters' (transformers' weight conversions, e.g.
fused MoE experts saved unfused) is refused by `streamable`, and the loop exports it
gathered, saying so.
"""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from huggingface_hub import split_torch_state_dict_into_shards
from transformers.core_model_loading import revert_weight_conversion
from transformers.modeling_utils import remove_tied_weights_from_state_dict

from protrain.train.checkpoint.final_dir import publish, tmp_dir
from protrain.train.modeling import trained_adapter_names

if TYPE_CHECKING:
    from protrain.train.ranks import Ranks
    from protrain.train.trainable import Trainable

# `save_pretrained`'s default split
MAX_SHARD_SIZE = "50GB"

# safetensors' dtype names, in the order its writer sorts tensors (largest first: its
# `Dtype` enum, descending), then by name
_SAFETENSORS_DTYPES = [
    (torch.bool, "BOOL"),
    (torch.uint8, "U8"),
    (torch.int8, "I8"),
    (torch.float8_e5m2, "F8_E5M2"),
    (torch.float8_e4m3fn, "F8_E4M3"),
    (torch.int16, "I16"),
    (torch.uint16, "U16"),
    (torch.float16, "F16"),
    (torch.bfloat16, "BF16"),
    (torch.int32, "I32"),
    (torch.uint32, "U32"),
    (torch.float32, "F32"),
    (torch.float64, "F64"),
    (torch.int64, "I64"),
    (torch.uint64, "U64"),
]
_DTYPE_NAME = {dtype: name for dtype, name in _SAFETENSORS_DTYPES}
_DTYPE_RANK = {dtype: i for i, (dtype, _) in enumerate(_SAFETENSORS_DTYPES)}


class SafetensorsStreamWriter:
    """One safetensors file written tensor by tensor: the header from the tensors' shapes
    and dtypes, then each tensor's bytes as it comes, in the file's order (`order`), which
    is the order `safetensors.torch.save_file` gives the same tensors (dtype, largest first,
    then name), so that the file's bytes are the same as its."""

    def __init__(self, path: Path, meta: dict[str, torch.Tensor], metadata: dict[str, str]):
        for name, t in meta.items():
            if t.dtype not in _DTYPE_NAME:
                raise ValueError(f"{name}: dtype {t.dtype} has no safetensors name")
        self.order = sorted(meta, key=lambda n: (-_DTYPE_RANK[meta[n].dtype], n))
        header: dict[str, object] = {"__metadata__": metadata} if metadata else {}
        offset = 0
        self._ends = {}
        for name in self.order:
            t = meta[name]
            nbytes = t.numel() * t.dtype.itemsize
            header[name] = {
                "dtype": _DTYPE_NAME[t.dtype],
                "shape": list(t.shape),
                "data_offsets": [offset, offset + nbytes],
            }
            offset += nbytes
            self._ends[name] = (t.shape, t.dtype, offset)
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)
        self.path = path
        self._next = 0
        self._file = open(path, "wb")  # noqa: SIM115 (closed by close())
        self._file.write(struct.pack("<Q", len(raw)) + raw)

    def write(self, name: str, tensor: torch.Tensor) -> None:
        """The next tensor of the file's order."""
        if self._next >= len(self.order) or self.order[self._next] != name:
            raise ValueError(f"{self.path.name}: {name!r} out of order")
        shape, dtype, _ = self._ends[name]
        if tuple(tensor.shape) != tuple(shape) or tensor.dtype != dtype:
            raise ValueError(
                f"{self.path.name}: {name!r} is {tuple(tensor.shape)} {tensor.dtype}, its "
                f"header says {tuple(shape)} {dtype}"
            )
        data = tensor.detach().to("cpu").contiguous().reshape(-1)
        self._file.write(memoryview(data.view(torch.uint8).numpy()))
        self._next += 1

    def close(self) -> None:
        self._file.close()
        if self._next != len(self.order):
            raise RuntimeError(
                f"{self.path.name}: {len(self.order) - self._next} tensors unwritten"
            )


def saved_meta(trainable: Trainable) -> dict[str, torch.Tensor] | None:
    """Name -> meta tensor (shape and dtype) of what `save_pretrained` would write for the
    trained model, or None where its names are not the parameters' (weight conversions)."""
    model = trainable.model
    meta = {
        name: torch.empty(shape, dtype=dtype, device="meta")
        for name, (shape, dtype) in trainable.export_shapes.items()
    }
    for key in getattr(model, "_keys_to_ignore_on_save", None) or []:
        meta.pop(key, None)
    meta = remove_tied_weights_from_state_dict(meta, model)
    try:  # what save_pretrained writes: the same names and tensors where nothing converts
        reverted = revert_weight_conversion(model, dict(meta))
    except Exception:  # a conversion that cannot run on shapes alone: converts
        return None
    if set(reverted) != set(meta) or any(reverted[k] is not meta[k] for k in meta):
        return None
    return reverted  # in its order, which decides the split into files


def streamable(trainable: Trainable) -> str | None:
    """Why this run's export cannot be streamed, or None where it can."""
    model = trainable.model
    if getattr(model, "hf_quantizer", None) is not None:
        return "the model is quantized by transformers"
    if not hasattr(model, "save_pretrained"):
        return f"{type(model).__name__} has no save_pretrained"
    if not _is_peft(model) and saved_meta(trainable) is None:
        return "transformers converts its weights' names on save (weight conversions)"
    return None


def _is_peft(model) -> bool:
    return hasattr(model, "peft_config") and hasattr(model, "get_base_model")


def export_streamed(
    trainable: Trainable,
    tokenizer,
    final_dir: Path,
    ranks: Ranks,
    *,
    write_extra=None,
    max_shard_size: int | str = MAX_SHARD_SIZE,
) -> None:
    """Every rank calls it (the gathers are collectives); rank 0 writes ``final_dir``
    atomically (a temporary name, then one rename). ``write_extra(tmp)``: rank 0's further
    files (the built-in tiny base beside an adapter)."""
    tmp = tmp_dir(final_dir)
    if ranks.is_main:
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
    if _is_peft(trainable.model):
        _export_adapter(trainable, tmp, ranks)
    else:
        _export_full(trainable, tmp, ranks, max_shard_size)
    if ranks.is_main:
        tokenizer.save_pretrained(tmp)
        if write_extra is not None:
            write_extra(tmp)
        publish(tmp, final_dir)  # [Note: replacing final] in final_dir.py


def _export_adapter(trainable: Trainable, tmp: Path, ranks: Ranks) -> None:
    """The trainable tensors gathered (the adapter, small), peft writes the directory."""
    state = {}
    for name in trainable.names:
        value = trainable.full_tensor(name)
        if ranks.is_main:
            state[name] = value
    if ranks.is_main:
        trainable.model.save_pretrained(
            tmp,
            state_dict=state,
            safe_serialization=True,
            selected_adapters=trained_adapter_names(trainable.model, trainable.names),
        )


def _export_full(trainable: Trainable, tmp: Path, ranks: Ranks, max_shard_size) -> None:
    meta = saved_meta(trainable)
    assert meta is not None, "streamable() refuses such a model"
    split = split_torch_state_dict_into_shards(
        meta, filename_pattern="model{suffix}.safetensors", max_shard_size=max_shard_size
    )
    if ranks.is_main:
        _write_configs(trainable, tmp)
    for filename, names in split.filename_to_tensors.items():
        part = {name: meta[name] for name in names}
        writer = (
            SafetensorsStreamWriter(tmp / filename, part, {"format": "pt"})
            if ranks.is_main
            else None
        )
        order = sorted(part, key=lambda n: (-_DTYPE_RANK[part[n].dtype], n))
        for name in order:
            value = trainable.full_tensor(name)  # every rank: a collective
            if writer is not None:
                writer.write(name, value)
            del value
        if writer is not None:
            writer.close()
    if ranks.is_main and split.is_sharded:
        index = {
            "metadata": {"total_parameters": trainable.export_numel, **split.metadata},
            "weight_map": split.tensor_to_filename,
        }
        (tmp / "model.safetensors.index.json").write_text(
            json.dumps(index, indent=2, sort_keys=True) + "\n"
        )


def _write_configs(trainable: Trainable, tmp: Path) -> None:
    """The config and generation config as `save_pretrained` writes them: the config's dtype
    is the trained model's (its first floating-point parameter's, as saved), and its
    architecture the model's class."""
    model = trainable.model
    config = model.config
    floats = [dtype for _, dtype in trainable.export_param_dtypes if dtype.is_floating_point]
    if floats:
        config.dtype = str(floats[0]).split(".")[1]
    config.architectures = [type(model).__name__.removeprefix("FSDP")]
    config.save_pretrained(tmp)
    if model.can_generate():
        model.generation_config.save_pretrained(tmp)
