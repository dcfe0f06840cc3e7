"""Every policy, and mixes of them, train exactly what plain PyTorch trains (fp32 on CPU).

STEPS AdamW steps of gradient accumulation ACCUM on tiny random Llama and Qwen2 models, full
fine-tuning and LoRA, against the same model trained without any policy: the micro-batch
losses and every parameter after training agree to 1e-6.
"""

from __future__ import annotations

import copy

import pytest
import torch
from transformers.cache_utils import Cache

from protrain.activations import apply_activation_policies, place_policies

from .models import ACCUM, STEPS, batches, build, lora, train

N_BLOCKS = 4
POLICIES = {
    "checkpoint": ["checkpoint"] * N_BLOCKS,
    "swap": ["swap"] * N_BLOCKS,
    "offload_checkpoint": ["offload_checkpoint"] * N_BLOCKS,
    "rule_1swap_2ckpt": place_policies(N_BLOCKS, n_swap=1, n_checkpoint=2),
    "all_four": ["swap", "offload_checkpoint", "checkpoint", "keep"],
}


def _assert_same(model, reference, losses, ref_losses, what):
    assert losses == pytest.approx(ref_losses, abs=1e-6, rel=1e-6), what
    ref_state = reference.state_dict()
    state = model.state_dict()
    assert state.keys() == ref_state.keys()
    for name, ref in ref_state.items():
        torch.testing.assert_close(state[name], ref, atol=1e-6, rtol=0, msg=f"{what} {name}")


@pytest.mark.parametrize("mode", ["full", "lora"])
@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_policies_train_like_plain_pytorch(kind, mode):
    base = build(kind)
    if mode == "lora":
        base = lora(base)
    data = batches(STEPS * ACCUM)
    reference = copy.deepcopy(base)
    ref_losses = train(reference, data)

    for policy, policies in POLICIES.items():
        model = copy.deepcopy(base)
        handle = apply_activation_policies(model, policies, device="cpu")
        losses = train(model, data)
        _assert_same(model, reference, losses, ref_losses, (kind, mode, policy))
        if handle.swapper is not None:
            t = handle.swapper.transfer
            assert t.bytes_to_host > 0 and t.bytes_to_device == t.bytes_to_host, policy
        handle.remove()


def test_remove_restores_the_plain_model():
    model = build("llama")
    blocks = [model.model.layers[i] for i in range(N_BLOCKS)]
    handle = apply_activation_policies(
        model, POLICIES["all_four"], device="cpu", tiled_mlp_tokens=4
    )
    assert all("forward" in b.__dict__ for b in blocks[:3]) and "forward" not in blocks[3].__dict__
    with pytest.raises(RuntimeError, match="already has activation policies"):
        apply_activation_policies(model, POLICIES["swap"], device="cpu")
    handle.remove()
    assert all("forward" not in b.__dict__ and "forward" not in b.mlp.__dict__ for b in blocks)
    apply_activation_policies(model, POLICIES["swap"], device="cpu").remove()


def test_policies_by_block_name_and_errors():
    model = build("llama")
    handle = apply_activation_policies(model, {"model.layers.1": "swap"}, device="cpu")
    assert [p.value for p in handle.policies] == ["keep", "swap", "keep", "keep"]
    handle.remove()
    with pytest.raises(ValueError, match="3 policies given for the model's 4 blocks"):
        apply_activation_policies(model, ["keep"] * 3, device="cpu")
    with pytest.raises(ValueError, match="not a policy"):
        apply_activation_policies(model, ["keep", "recompute", "keep", "keep"], device="cpu")
    with pytest.raises(ValueError, match="does not have"):
        apply_activation_policies(model, {"model.layers.9": "swap"}, device="cpu")


def test_eval_and_no_grad_run_the_plain_forward():
    model = build("llama")
    data = batches(1)[0]
    with torch.no_grad():
        ref = model(**data).logits
    handle = apply_activation_policies(model, POLICIES["all_four"], device="cpu")
    with torch.no_grad():
        out = model(**data).logits
    torch.testing.assert_close(out, ref, atol=0, rtol=0)
    assert handle.swapper.transfer.bytes_to_host == 0
    handle.remove()


def test_knobs_place_by_the_rule():
    from protrain.activations import apply_activation_knobs

    model = build("llama")
    handle = apply_activation_knobs(
        model, n_swap=1, n_checkpoint=2, device="cpu", offload_checkpoint_inputs=True
    )
    assert [p.value for p in handle.policies] == [
        "swap",
        "offload_checkpoint",
        "offload_checkpoint",
        "keep",
    ]
    model(**batches(1)[0]).loss.backward()
    handle.remove()
    with pytest.raises(ValueError, match="more than the model's 4 blocks"):
        apply_activation_knobs(model, n_swap=3, n_checkpoint=2, device="cpu")


def test_a_failed_apply_leaves_the_model_as_it_was():
    model = build("llama")
    with pytest.raises(ValueError, match="tile_tokens"):
        apply_activation_policies(model, POLICIES["all_four"], device="cpu", tiled_mlp_tokens=0)
    assert all("forward" not in layer.__dict__ for layer in model.model.layers)
    apply_activation_policies(model, POLICIES["swap"], device="cpu").remove()


@pytest.mark.parametrize("use_cache", [True, False])
def test_recomputed_blocks_get_no_cache(use_cache):
    """A cache filled again by recomputation would double the keys (eager attention fails)."""
    base = build("llama", attn_implementation="eager")
    data = {**batches(1)[0], "use_cache": use_cache}
    ref = copy.deepcopy(base)
    ref(**data).loss.backward()
    model = copy.deepcopy(base)
    caches = []
    model.model.layers[1].self_attn.register_forward_hook(
        # Any cache object, under whatever name the release passes it.
        lambda m, a, kw, out: caches.append([k for k, v in kw.items() if isinstance(v, Cache)]),
        with_kwargs=True,
    )
    handle = apply_activation_policies(model, ["checkpoint", "offload_checkpoint"] * 2)
    model(**data).loss.backward()
    assert caches == [[], []]  # forward and recomputation
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, atol=1e-6, rtol=0, msg=name)
    handle.remove()
