"""Flat tensors through ``torch.distributed.checkpoint`` (DCP): every rank saves, and loads,
its own element ranges of 1-D tensors named by key, at any split on either side.

[Note: flat pieces and custom planners]
A sharded chunk gives each rank a contiguous run of every parameter's flattened elements,
cut wherever the chunk's byte shards fall (``chunks/shard.py``): uneven, possibly empty,
and not a split that DTensor can describe (``Shard(0)`` on a 1-D mesh cuts ``torch.chunk``
ranges; ``ShardedTensor``, which can, is on its way out of torch). DCP's documented
extension points are its planners, so this module writes one of each, small: the save
planner puts, for every key a rank holds a piece of, one write item whose chunk metadata is
that piece's ``(offset,)`` and ``(length,)`` in the key's whole flat tensor; DCP checks at
save time that the pieces of all ranks cover every key exactly once and records them in
its ``.metadata``. The load planner asks for each of this rank's pieces, at whatever split
the loading run has, and DCP's own resharding (``create_read_items_for_chunk_list``) reads
the overlaps of the saved chunks into views of the destination tensors. The files, their
layout and the reads are DCP's (``FileSystemWriter`` / ``FileSystemReader``); only the
``.metadata`` read is ours, see [Note: metadata without pickle's globals].

[Note: metadata without pickle's globals]
DCP writes ``.metadata`` with ``pickle.dump`` and its reader loads it with ``pickle.load``,
which would run whatever a crafted file names. ``SafeFileSystemReader`` unpickles it with
``find_class`` limited to DCP's metadata dataclasses and the few torch values they hold
(``torch.Size``, dtypes, layouts, memory formats); the tensors themselves DCP reads with
``torch.load(weights_only=True)``. A file naming anything else is refused, named.
"""

from __future__ import annotations

import dataclasses
import io
import pickle
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadPlan,
    SavePlan,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

METADATA_FILE = ".metadata"


@dataclasses.dataclass
class FlatPiece:
    """Elements ``[offset, offset + tensor.numel())`` of the flat tensor ``key`` of
    ``total`` elements; ``tensor`` is 1-D and contiguous (the data to save, or the place a
    load writes into)."""

    key: str
    tensor: torch.Tensor
    offset: int
    total: int

    def __post_init__(self) -> None:
        if self.tensor.dim() != 1 or not self.tensor.is_contiguous():
            raise ValueError(f"{self.key}: a flat piece is a contiguous 1-D tensor")
        if not 0 <= self.offset <= self.offset + self.tensor.numel() <= self.total:
            raise ValueError(
                f"{self.key}: elements [{self.offset}, {self.offset + self.tensor.numel()}) "
                f"are not within its {self.total}"
            )


class CheckpointMismatch(ValueError):
    """The checkpoint does not hold what the load asks for (another model, another state)."""


def save_pieces(
    pieces: list[FlatPiece],
    directory: Path,
    group=None,
    thread_count: int = 1,
    before_write: Callable[[str], None] | None = None,
) -> None:
    """Write this rank's pieces into ``directory`` (DCP: one ``__<rank>_<n>.distcp`` per
    rank and thread, ``.metadata`` from the coordinator, every file fsynced). With a process
    group, a collective: every rank calls it, each with its own pieces; empty pieces are
    left out. ``before_write(name)`` runs just before this rank writes each file."""
    pieces = [p for p in pieces if p.tensor.numel()]
    state = {p.key: p.tensor for p in pieces}
    if len(state) != len(pieces):
        raise ValueError("save_pieces: one piece per key on a rank")
    with _dcp_call():
        dcp.save(
            state,
            storage_writer=_Writer(
                directory, before_write, sync_files=True, thread_count=thread_count
            ),
            planner=_FlatSavePlanner({p.key: (p.offset, p.total) for p in pieces}),
            process_group=group,
            no_dist=not _several(group),
        )


def load_pieces(pieces: list[FlatPiece], directory: Path, group=None) -> None:
    """Fill every piece's tensor from the checkpoint in ``directory``, whatever the split it
    was saved with. With a process group, a collective. A checkpoint that lacks a key, holds
    it at another length or dtype, or whose data files are missing or short raises
    ``CheckpointMismatch`` naming the key and the file, before anything is read."""
    pieces = [p for p in pieces if p.tensor.numel()]
    state = {p.key: p.tensor for p in pieces}
    if len(state) != len(pieces):
        raise ValueError("load_pieces: one piece per key on a rank")
    md = read_metadata(directory)
    check_files(directory, md)
    for p in pieces:
        _check_saved(md, directory, p.key, p.total, p.tensor.dtype)
    with _dcp_call():
        dcp.load(
            state,
            storage_reader=SafeFileSystemReader(directory),
            planner=_FlatLoadPlanner({p.key: (p.offset, p.total) for p in pieces}, directory),
            process_group=group,
            no_dist=not _several(group),
        )


def check_files(directory: Path, md: Metadata | None = None) -> None:
    """Every data file the metadata points into exists and is long enough."""
    md = md if md is not None else read_metadata(directory)
    needed: dict[str, int] = {}
    for info in (md.storage_data or {}).values():
        end = info.offset + info.length
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), end)
    for name, nbytes in sorted(needed.items()):
        path = directory / name
        if not path.is_file():
            raise CheckpointMismatch(f"{path} is missing (its rank's part of the checkpoint)")
        size = path.stat().st_size
        if size < nbytes:
            raise CheckpointMismatch(
                f"{path} is truncated: {size} bytes, the metadata points up to byte {nbytes}"
            )


def saved_keys(directory: Path) -> dict[str, int]:
    """Key -> whole flat length of every tensor in the checkpoint (its metadata alone)."""
    md = read_metadata(directory)
    return {
        k: int(v.size[0]) if len(v.size) else 1
        for k, v in md.state_dict_metadata.items()
        if isinstance(v, TensorStorageMetadata)
    }


def data_files(directory: Path) -> set[str]:
    """The data files (one or more per rank) the checkpoint's metadata points into."""
    md = read_metadata(directory)
    return {info.relative_path for info in (md.storage_data or {}).values()}


def read_metadata(directory: Path) -> Metadata:
    return SafeFileSystemReader(directory).read_metadata()


def _several(group) -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1


class _dcp_call:
    """Around a DCP save or load: its one-process notice silenced (one process is what we
    ask for), and a failure on any rank raised as the ``CheckpointMismatch`` or ``OSError``
    it was, not as DCP's ``CheckpointException`` (a BaseException holding tracebacks)."""

    def __enter__(self) -> None:
        self._warnings = warnings.catch_warnings()
        self._warnings.__enter__()
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")

    def __exit__(self, kind, exc, tb) -> bool:
        self._warnings.__exit__(kind, exc, tb)
        if isinstance(exc, CheckpointException):
            errors = [e for e, _ in exc.failures.values()]
            for wanted in (CheckpointMismatch, OSError):
                for e in errors:
                    if isinstance(e, wanted):
                        raise e from None
            raise RuntimeError(
                "torch.distributed.checkpoint failed on rank(s) "
                f"{sorted(exc.failures)}: {errors[0]!r}"
            ) from None
        return False


def _check_saved(md: Metadata, directory: Path, key: str, total: int, dtype) -> None:
    where = directory / METADATA_FILE
    saved = md.state_dict_metadata.get(key)
    if not isinstance(saved, TensorStorageMetadata):
        raise CheckpointMismatch(f"{where} holds no tensor {key!r}")
    if tuple(saved.size) != (total,):
        raise CheckpointMismatch(
            f"{where}: {key!r} has {tuple(saved.size)} elements saved, this run has ({total},)"
        )
    if saved.properties.dtype != dtype:
        raise CheckpointMismatch(
            f"{where}: {key!r} was saved as {saved.properties.dtype}, this run holds {dtype}"
        )
    covered = sum(c.sizes[0] for c in saved.chunks)
    if covered != total:
        raise CheckpointMismatch(
            f"{where}: the saved pieces of {key!r} hold {covered} of its {total} elements"
        )


class _Writer(FileSystemWriter):
    """DCP's file writer, telling ``before_write`` the name of each file it is about to
    write (the application's tests kill a rank there)."""

    def __init__(self, path: Path, before_write: Callable[[str], None] | None, **kwargs):
        super().__init__(path, **kwargs)
        self._before_write = before_write or (lambda name: None)

    def write_data(self, plan, planner):
        prefix = getattr(plan.storage_data, "prefix", "")
        for n in range(max(1, self.thread_count)):
            self._before_write(f"{prefix}{n}.distcp")
        return super().write_data(plan, planner)

    def finish(self, metadata, results) -> None:
        self._before_write(METADATA_FILE)
        super().finish(metadata, results)


class _FlatSavePlanner(DefaultSavePlanner):
    """Each piece is one write item: its chunk in the key's flat tensor (see [Note: flat
    pieces and custom planners]). The global plan (dedup, metadata, checks) is DCP's."""

    def __init__(self, ranges: dict[str, tuple[int, int]]):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self._ranges = ranges

    def create_local_plan(self) -> SavePlan:
        items = []
        for key, t in self.state_dict.items():
            offset, total = self._ranges[key]
            items.append(
                WriteItem(
                    index=MetadataIndex(key, torch.Size((offset,))),
                    type=WriteItemType.SHARD,
                    tensor_data=TensorWriteData(
                        chunk=ChunkStorageMetadata(
                            offsets=torch.Size((offset,)), sizes=torch.Size((t.numel(),))
                        ),
                        properties=TensorProperties.create_from_tensor(t),
                        size=torch.Size((total,)),
                    ),
                )
            )
        self.plan = SavePlan(items)
        return self.plan

    def lookup_object(self, index: MetadataIndex):
        return self.state_dict[index.fqn]


class _FlatLoadPlanner(DefaultLoadPlanner):
    """Reads for each piece the overlaps of the saved chunks (DCP's resharding)."""

    def __init__(self, ranges: dict[str, tuple[int, int]], directory: Path):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self._ranges = ranges
        self._directory = directory

    def create_local_plan(self) -> LoadPlan:
        md = self.metadata.state_dict_metadata
        items = []
        for key, t in self.state_dict.items():
            offset, total = self._ranges[key]
            _check_saved(self.metadata, self._directory, key, total, t.dtype)
            local = ChunkStorageMetadata(
                offsets=torch.Size((offset,)), sizes=torch.Size((t.numel(),))
            )
            items += create_read_items_for_chunk_list(key, md[key], [local])
        return LoadPlan(items)

    def resolve_tensor(self, read_item) -> torch.Tensor:
        t = self.state_dict[read_item.dest_index.fqn]
        start, length = read_item.dest_offsets[0], read_item.lengths[0]
        return t.narrow(0, start, length)


# -- [Note: metadata without pickle's globals] -----------------------------------------------

_METADATA_CLASSES = {
    ("torch.distributed.checkpoint.metadata", name)
    for name in (
        "Metadata",
        "TensorStorageMetadata",
        "ChunkStorageMetadata",
        "TensorProperties",
        "BytesStorageMetadata",
        "MetadataIndex",
        "StorageMeta",
        "_MEM_FORMAT_ENCODING",
    )
} | {("torch.distributed.checkpoint.filesystem", "_StorageInfo")}
_TORCH_VALUES = (torch.dtype, torch.layout, torch.memory_format)


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if (module, name) in _METADATA_CLASSES:
            return super().find_class(module, name)
        if module == "torch" and name == "Size":
            return torch.Size
        if module == "torch" and isinstance(getattr(torch, name, None), _TORCH_VALUES):
            return getattr(torch, name)
        if (module, name) == ("torch.serialization", "_get_layout"):  # a layout by its name
            return super().find_class(module, name)
        if module == "pathlib" and name in ("PosixPath", "WindowsPath", "PurePosixPath"):
            return super().find_class(module, name)  # storage_meta.checkpoint_id
        if (module, name) == ("collections", "OrderedDict"):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not allowed in DCP metadata")


class SafeFileSystemReader(FileSystemReader):
    """DCP's file reader, its ``.metadata`` read without arbitrary pickle globals."""

    def read_metadata(self, *args, **kwargs) -> Metadata:
        rank = kwargs.get("rank")  # DCP's rank-local metadata files: __<rank>.metadata
        name = METADATA_FILE if rank is None else f"__{rank}{METADATA_FILE}"
        path = Path(self.path) / name
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            raise CheckpointMismatch(f"{path} is missing") from None
        try:
            metadata = _MetadataUnpickler(io.BytesIO(data)).load()
        except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError) as exc:
            raise CheckpointMismatch(f"{path} is not DCP metadata ({exc})") from None
        if not isinstance(metadata, Metadata):
            raise CheckpointMismatch(f"{path} is not DCP metadata ({type(metadata).__name__})")
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata
