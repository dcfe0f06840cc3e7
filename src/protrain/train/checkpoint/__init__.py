"""Checkpoints and the final export of a training run.

- `directory.py`: the `checkpoint-*` directories of an output_dir, whatever their format:
  the manifest, the atomic rename, pruning, finding the newest intact one to resume from.
- `plain.py`: the format one process writes (safetensors and JSON).
- `sharded.py`: the format several ranks write together (torch.distributed.checkpoint).
- `convert.py`: `protrain convert-checkpoint`, one format into the other.
- `final_dir.py`: putting a finished model directory in place atomically.
- `streamed_export.py`: the final model written shard by shard, without a whole copy in memory.
- `disk.py`: the file-system steps they share (fsync, hashes, I/O errors).

The names below are the entry points a run uses; the modules hold the rest.
"""

from protrain.train.checkpoint.directory import (
    CHECKPOINT_RE,
    PLAIN,
    SHARDED,
    TMP_PREFIX,
    checkpoint_bytes,
    checkpoint_format,
    clean_leftovers,
    complete_unrenamed_saves,
    find_resume_checkpoint,
    latest_checkpoint,
    list_checkpoints,
    space_needed_bytes,
    verify,
)
from protrain.train.checkpoint.disk import as_os_error, fsync_path, is_no_space
from protrain.train.checkpoint.plain import (
    Checkpoint,
    load_checkpoint,
    restore_rng,
    save_checkpoint,
)

__all__ = [
    "CHECKPOINT_RE",
    "PLAIN",
    "SHARDED",
    "TMP_PREFIX",
    "Checkpoint",
    "as_os_error",
    "checkpoint_bytes",
    "checkpoint_format",
    "clean_leftovers",
    "complete_unrenamed_saves",
    "find_resume_checkpoint",
    "fsync_path",
    "is_no_space",
    "latest_checkpoint",
    "list_checkpoints",
    "load_checkpoint",
    "restore_rng",
    "save_checkpoint",
    "space_needed_bytes",
    "verify",
]
