"""The FSDP2 engine's optimizer: AdamW over DTensor shards that loads a whole state dict."""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor import DTensor, distribute_tensor


class FullStateAdamW(torch.optim.AdamW):
    """AdamW over sharded (DTensor) parameters that loads a whole state dict: each state
    tensor of a parameter's full shape is cut to this rank's shard (every rank holds the
    checkpoint, so no collective)."""

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        params = [p for group in self.param_groups for p in group["params"]]
        state = {}
        for index, values in state_dict["state"].items():
            param = params[int(index)]
            state[index] = {k: _own_shard(v, param) for k, v in values.items()}
        super().load_state_dict({**state_dict, "state": state})


def _own_shard(value: Any, param: torch.Tensor) -> Any:
    if not (isinstance(param, DTensor) and isinstance(value, torch.Tensor)):
        return value
    if isinstance(value, DTensor) or value.shape != param.shape:
        return value  # already a shard, or a scalar such as `step`
    local = param.to_local()
    shard = distribute_tensor(
        value, param.device_mesh, param.placements, src_data_rank=None
    ).to_local()
    return DTensor.from_local(
        shard.to(local.device, local.dtype),
        param.device_mesh,
        param.placements,
        run_check=False,
        shape=param.shape,
        stride=param.stride(),
    )
