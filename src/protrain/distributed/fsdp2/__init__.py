"""The FSDP2 engine: `torch.distributed.fsdp.fully_shard` units chosen by a wrap policy,
their gradients summed over ranks, prefetch in execution order, 4-bit weights sharded in the
computing dtype (`units.py`); AdamW over the shards that loads a whole state dict
(`optimizer.py`); the trainable state as flat pieces of a sharded checkpoint that any
engine resumes (`checkpoint.py`). It imports nothing of `protrain.train`: the application
builds on it (`train/fsdp2_trainable.py`, the loop's `Trainable`; `train/fsdp2_trace.py`,
the peak that `protrain plan` measures).
"""

from protrain.distributed.fsdp2.units import (
    DEFAULT_MIN_NUM_PARAMS,
    SIZE_BASED_WRAP,
    TRANSFORMER_BASED_WRAP,
    FSDP2Settings,
    PrefetchOrder,
    apply_fsdp2,
    choose_units,
    prefetch_order,
    prepare_4bit,
    release_groups,
    set_prefetch,
    size_based_units,
    transformer_units,
)

__all__ = [
    "DEFAULT_MIN_NUM_PARAMS",
    "FSDP2Settings",
    "PrefetchOrder",
    "SIZE_BASED_WRAP",
    "TRANSFORMER_BASED_WRAP",
    "apply_fsdp2",
    "choose_units",
    "prefetch_order",
    "prepare_4bit",
    "release_groups",
    "set_prefetch",
    "size_based_units",
    "transformer_units",
]
