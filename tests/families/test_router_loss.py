"""The loop's loss of a Mixture-of-Experts model whose config sets `output_router_logits`
is the model's own (cross-entropy plus `router_aux_loss_coef * aux_loss`), with the head
whole or in chunks ([Note: the router loss] in `protrain/train/loss.py`); the load-balancing
term was silently dropped before. Without it, the cross-entropy alone, as the model's."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from protrain.train.loss import count_trained_tokens, loss_sum

from .configs import FAMILIES, batches

MOE = [name for name, f in FAMILIES.items() if f.kind == "moe"]


@pytest.mark.parametrize("router", [True, False])
@pytest.mark.parametrize("name", MOE)
def test_loss_is_the_models_own(name, router):
    cfg = dict(FAMILIES[name].config, output_router_logits=router, router_aux_loss_coef=0.02)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(name, **cfg)).train()
    batch = batches(name, 1)[0]
    own = model(**batch)
    if router:
        assert own.aux_loss is not None and float(own.aux_loss) > 0
    tokens = count_trained_tokens(batch["labels"])
    cpu = torch.device("cpu")
    for chunk in (None, 5):
        got = loss_sum(model, batch, cpu, chunked_loss_tokens=chunk) / tokens
        torch.testing.assert_close(got, own.loss, atol=2e-6, rtol=0, msg=f"{name} {chunk}")
