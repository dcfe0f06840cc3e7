"""Recomputed blocks run without a key-value cache, whatever the family calls it.

Each family is called with ``use_cache=True`` (most configs' default, which Mamba alone turns
off in training) and a padded ``attention_mask``. Llama receives its cache as ``cache=`` (transformers 5.24) or
``past_key_values=``, GPT-2 positionally, Mamba and Qwen3-Next (linear attention beside full
attention) as ``cache_params=`` or ``cache=``. A block recomputed with the cache would
append to it a second time: a ``CheckpointError``, a shape error, or silently different
gradients. Checked: no module inside a checkpointed block sees a cache, and the gradients
equal those of the model without policies.
"""

from __future__ import annotations

import copy

import pytest
import torch
import transformers
from transformers.cache_utils import Cache

from protrain.activations import apply_activation_policies
from protrain.model.blocks import discover_blocks

VOCAB = 96
SMALL = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2)
ATTN = dict(num_attention_heads=4, num_key_value_heads=2, intermediate_size=64)
FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {**SMALL, **ATTN}),
    "gpt2": (
        "GPT2Config",
        "GPT2LMHeadModel",
        dict(
            vocab_size=VOCAB,
            n_embd=32,
            n_layer=2,
            n_head=4,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
        ),
    ),
    "mamba": ("MambaConfig", "MambaForCausalLM", {**SMALL, "state_size": 8, "expand": 2}),
    "qwen3_next": (
        "Qwen3NextConfig",
        "Qwen3NextForCausalLM",
        {
            **SMALL,
            **ATTN,
            "head_dim": 8,
            "linear_num_key_heads": 2,
            "linear_num_value_heads": 2,
            "linear_key_head_dim": 8,
            "linear_value_head_dim": 8,
            "layer_types": ["linear_attention", "full_attention"],
            "num_experts": 0,  # a dense MLP: the cache is what is tested here
        },
    ),
}
CACHE_NAMES = ("past_key_values", "past_key_value", "layer_past", "cache", "cache_params")


def _build(family: str) -> torch.nn.Module:
    config_cls, model_cls, cfg = FAMILIES[family]
    torch.manual_seed(0)
    config = getattr(transformers, config_cls)(**cfg)
    config._attn_implementation = "eager"
    return getattr(transformers, model_cls)(config).train()


def _batch() -> dict:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (2, 10), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # left padding: the masked path that a doubled cache breaks
    labels = ids.masked_fill(mask == 0, -100)
    return {"input_ids": ids, "attention_mask": mask, "labels": labels, "use_cache": True}


def _record_caches(block: torch.nn.Module, seen: list[str]) -> None:
    """Hooks on every module inside ``block`` that note any cache they are called with."""

    def hook(module, args, kwargs):
        for i, a in enumerate(args):
            if isinstance(a, Cache):
                seen.append(f"{type(module).__name__} positional {i}")
        for k, v in kwargs.items():
            if isinstance(v, Cache) or (k in CACHE_NAMES and v is not None):
                seen.append(f"{type(module).__name__} {k}=")

    for sub in list(block.modules())[1:]:
        sub.register_forward_pre_hook(hook, with_kwargs=True)


@pytest.mark.parametrize("policy", ["checkpoint", "offload_checkpoint"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_recomputed_blocks_get_no_cache(family, policy):
    base = _build(family)
    batch = _batch()
    ref = copy.deepcopy(base)
    ref(**batch).loss.backward()

    model = copy.deepcopy(base)
    blocks = discover_blocks(model).blocks
    seen: list[str] = []
    for block in blocks:
        _record_caches(block.module, seen)
    handle = apply_activation_policies(model, [policy] * len(blocks), device="cpu")
    model(**batch).loss.backward()
    handle.remove()

    assert seen == [], f"{family}: a checkpointed block saw a cache: {seen[:4]}"
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, atol=1e-6, rtol=0, msg=name)
