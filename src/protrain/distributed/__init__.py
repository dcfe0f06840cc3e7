"""Several ranks: the process group, the sharded chunk storage and the collectives.

- ``process_group.py``: which ranks train together (``DistContext``), found from an
  initialized ``torch.distributed`` group or from ``torchrun``'s environment;
- ``collectives.py``: the collectives the engine issues, in one place, bound to the group and
  the compute device (``ChunkCollectives``, which the chunk manager is given);
- ``grad_reducer.py``: gradients gathered chunk by chunk in backward and reduced across
  ranks (all-reduce for replicated chunks, reduce-scatter for sharded ones);
- ``sharded_state.py``: whole tensors of a sharded chunk put back together, for state dicts
  and close;
- ``agree.py``: what one rank decides for all (the planner's plan, a measurement, an error).

Which bytes of a chunk each rank owns is layout arithmetic and lives with the chunks
(``protrain.chunks.shard``). At world size 1 none of this runs and the engine behaves as on one device.
"""

from protrain.distributed.collectives import ChunkCollectives
from protrain.distributed.process_group import (
    NO_GROUP,
    DistContext,
    init_from_env,
    resolve_context,
)

__all__ = ["NO_GROUP", "ChunkCollectives", "DistContext", "init_from_env", "resolve_context"]
