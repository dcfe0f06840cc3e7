"""The plan's loss chunk is the one `memory: {auto: true}` trains with."""

import pytest
import torch

import protrain.activations as activations
import protrain.train.trainable as trainable_module
from protrain.train import planning
from protrain.train.config import validate_config
from protrain.train.trainable import AutoTrainable

from .helpers import tiny_config


def test_the_plans_loss_chunk_reaches_the_apps_loss(tmp_path, monkeypatch):
    memory = {"auto": True, "gpu_budget": "100MiB"}
    cfg = validate_config(tiny_config(tmp_path, sequence_len=32, micro_batch_size=2, memory=memory))
    monkeypatch.setattr(planning, "LOSS_CHUNK_FLOOR_TOKENS", 16)  # 64 positions: off, 32, 16
    model, batch, settings = planning.planning_inputs(cfg)
    plan_memory = planning.plan_memory

    def tight(model, batch, settings):  # what a budget without the whole logits picks
        plan, problem = plan_memory(model, batch, settings)
        assert plan.loss_planned and settings.loss_chunk_floor_tokens == 16
        plan.chunked_loss_tokens = 16
        return plan, problem

    monkeypatch.setattr(trainable_module, "plan_memory", tight)
    trainable = AutoTrainable(model, cfg, settings.device, None, batch)
    seen = []
    chunked_loss = activations.chunked_causal_lm_loss_sum

    def spy(*args, **kwargs):
        seen.append(kwargs["chunk_tokens"])
        return chunked_loss(*args, **kwargs)

    monkeypatch.setattr(activations, "chunked_causal_lm_loss_sum", spy)
    try:
        assert trainable.chunked_loss_tokens == 16
        with torch.no_grad():
            chunked = trainable.forward_loss_sum(batch).item()
            trainable.chunked_loss_tokens = None
            whole = trainable.forward_loss_sum(batch).item()
    finally:
        trainable.close()
    assert seen == [16]
    assert chunked == pytest.approx(whole, rel=1e-6)
