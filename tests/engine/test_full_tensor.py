"""`protrain.full_tensor` (one state-dict entry at a time, what a streamed export reads),
`protrain.own_values` (this rank's own values, for the final check) and
`protrain.close(keep_weights=False)` (the end of a run whose weights are written) on one
process; the sharded gather of one parameter is `tests/multirank/test_streamed_export.py`'s."""

from __future__ import annotations

import pytest
import torch

import protrain

from .models import batches, build, lora
from .test_api import _wrap
from .test_equivalence import train_engine


@pytest.mark.parametrize("mode", ["full", "lora"])
def test_full_tensor_is_the_state_dicts_entry(mode):
    base = lora(build("llama"), "llama") if mode == "lora" else build("llama")
    dtypes = {n: p.dtype for n, p in base.named_parameters()}
    model, opt, _ = _wrap(base, n_persist=1, compute_dtype=torch.bfloat16)
    train_engine(model, batches("llama", 12), opt)
    state = protrain.state_dict(model)
    for name, want in state.items():
        got = protrain.full_tensor(model, name)
        assert got.dtype == dtypes.get(name, want.dtype), name
        assert torch.equal(got, want.to(got.dtype)), name
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    own = protrain.own_values(model, trainable)
    assert sorted(own) == sorted(trainable)
    for name in trainable:  # the fp32 masters
        assert own[name].dtype == torch.float32
        torch.testing.assert_close(own[name], state[name].float(), atol=0, rtol=0)
    protrain.close(model, keep_weights=False)
    assert all(p.numel() == 0 for p in model.parameters())
    with pytest.raises(RuntimeError, match="not wrapped"):
        protrain.full_tensor(model, trainable[0])
