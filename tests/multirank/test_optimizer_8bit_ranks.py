"""``optimizer="adamw_8bit"`` with several ranks is refused on every rank before anything
moves, with one message (its 8-bit state does not split into the sharded checkpoints)."""

from __future__ import annotations

import pytest

from .ranks import run_ranks

pytest.importorskip("bitsandbytes")


def _wrap_8bit(rank: int, world: int) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    import protrain

    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1)  # fmt: skip
    model = LlamaForCausalLM(cfg)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with pytest.raises(ValueError, match=r"optimizer='adamw_8bit' with several ranks \(2\)"):
        protrain.wrap(model, device="cpu", optimizer="adamw_8bit")
    assert not hasattr(model, "_protrain_engine")
    for n, p in model.named_parameters():  # nothing moved or changed
        assert p.device.type == "cpu" and torch.equal(p, before[n]), n


def test_8bit_optimizer_is_refused_on_several_ranks():
    run_ranks(2, _wrap_8bit)
