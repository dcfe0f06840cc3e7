"""Packed rows attend within their own sample without a dense (tokens x tokens) mask.

`sample_packing` lays a micro-batch's samples end to end in one row whose `position_ids`
restart at each sample (`protrain.train.data.collate`). Left unset, `model.attn_implementation`
is then flex_attention on a CUDA GPU where the class supports it: transformers builds a
`BlockMask` from those positions instead of the dense boolean mask SDPA gets. These tests
check the choice, and that the chosen path gives the same per-token losses as the same
samples unpacked (padded, one a row) under SDPA.

torch 2.13 has no flex_attention backward on the CPU ("FlexAttention does not support
backward on CPU"), so gradients cannot be compared here: the losses are compared in a
forward without grad, through the same compiled kernel training runs forward; the backward
is the GPU benchmark's (`benchmarks/run.py --pack-samples`).
"""

from __future__ import annotations

import copy

import pytest
import torch
from tests.families.configs import FAMILIES, build
from torch.nn.attention.flex_attention import BlockMask
from transformers import AutoModelForCausalLM
from transformers.masking_utils import create_causal_mask

from protrain.train import modeling
from protrain.train.attention import choose_attn_implementation
from protrain.train.config import validate_config
from protrain.train.data.collate import Collator

from .helpers import tiny_config

CUDA = torch.device("cuda")  # the choice reads the device's type only: no GPU is used
LENGTHS = (7, 13, 4, 10)  # samples of one packed row


def _choose(name: str, *, packing: bool, device: torch.device, backend: str = "default") -> str:
    model = build(name)
    return choose_attn_implementation(
        None, backend, type(model), model.config, packing=packing, device=device
    )


@pytest.mark.parametrize("name", ["llama", "qwen2"])
def test_packed_rows_on_a_gpu_take_flex_attention_and_say_why(name, protrain_log):
    assert _choose(name, packing=True, device=CUDA) == "flex_attention"
    said = [r for r in protrain_log if r.startswith("attention: ")]
    assert len(said) == 1 and said[0].startswith(
        "attention: flex_attention (model.attn_implementation unset; sample_packing on a CUDA "
        "GPU: each packed sample attends within itself through a block mask"
    ), said


def test_sdpa_stays_where_flex_does_not_apply():
    assert _choose("llama", packing=False, device=CUDA) == "sdpa"  # padded rows: is_causal
    assert _choose("llama", packing=True, device=torch.device("cpu")) == "sdpa"  # no backward
    assert _choose("llama", packing=True, device=CUDA, backend="cudnn") == "sdpa"  # forced SDPA
    assert not getattr(type(build("mamba")), "_supports_flex_attn", False)
    assert _choose("mamba", packing=True, device=CUDA) == "eager"  # neither flex nor sdpa


def test_an_explicit_implementation_is_kept_with_packing():
    model = build("llama")
    got = choose_attn_implementation(
        "sdpa", "default", type(model), model.config, packing=True, device=CUDA
    )
    assert got == "sdpa"


def test_the_run_passes_its_packing_and_device(tmp_path, monkeypatch):
    """The app's model loading hands `sample_packing` and the run's device to the choice."""
    monkeypatch.setattr(modeling, "resolve_device", lambda name: CUDA)
    model = build("llama")
    for packing, expected in ((True, "flex_attention"), (False, "sdpa")):
        cfg = validate_config(tiny_config(tmp_path, sample_packing=packing))
        got = modeling._attn_implementation(cfg, AutoModelForCausalLM, model.config)
        assert got == expected, packing


def _samples(seed: int) -> list[dict]:
    gen = torch.Generator().manual_seed(seed)
    items = []
    for n in LENGTHS:
        ids = torch.randint(3, FAMILIES["llama"].config["vocab_size"], (n,), generator=gen)
        items.append({"input_ids": ids.tolist(), "labels": ids.tolist()})
    return items


def _token_losses(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Each token's loss of predicting the next token of its own sample."""
    return torch.nn.functional.cross_entropy(logits[:-1], ids[1:], reduction="none")


@pytest.mark.parametrize("name", ["llama", "qwen2"])
def test_packed_rows_under_flex_give_the_losses_of_unpacked_rows(name):
    padded_model = build(name).eval()  # eval: no dropout; the math of training's forward
    chosen = choose_attn_implementation(
        None, "default", type(padded_model), padded_model.config, packing=True, device=CUDA
    )
    assert chosen == "flex_attention"
    packed_model = copy.deepcopy(padded_model)
    packed_model.set_attn_implementation(chosen)
    padded_model.set_attn_implementation("sdpa")

    items = _samples(seed=1)
    packed = Collator(None, sequence_len=64, packing=True)(items)
    padded = Collator(None, sequence_len=64, packing=False)(items)
    mask = create_causal_mask(
        config=packed_model.config,
        inputs_embeds=packed_model.get_input_embeddings()(packed["input_ids"]),
        attention_mask=None,
        cache=None,
        position_ids=packed["position_ids"],
    )
    assert isinstance(mask, BlockMask)  # no (tokens x tokens) tensor is built
    with torch.no_grad():  # no flex_attention backward on the CPU (module docstring)
        packed_logits = packed_model(
            input_ids=packed["input_ids"], position_ids=packed["position_ids"], use_cache=False
        ).logits[0]
        padded_logits = padded_model(
            input_ids=padded["input_ids"], attention_mask=padded["attention_mask"], use_cache=False
        ).logits

    start = 0
    for row, n in enumerate(LENGTHS):
        ids = padded["input_ids"][row, :n]
        want = _token_losses(padded_logits[row, :n], ids)
        got = _token_losses(packed_logits[start : start + n], ids)
        # fp32, two layers; each attention output is a softmax-weighted sum over at most 13
        # keys that the compiled flex kernel and SDPA's CPU kernel accumulate in different
        # orders (flex in exp2): a few ulps a sum. Measured: at most 4.8e-7 (1 ulp of a loss
        # of about 4.6); 1e-5 leaves room for other vector widths. A token that saw another
        # sample's keys is off by about 0.1 here.
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        start += n
