"""Where the engine's optimizer cannot do what torch's would, it says so instead of stepping
differently: a second clip of one window, and a parameter left without a gradient after
``zero_grad(set_to_none=False)`` (torch steps it with zeros). Every chunk is offloaded, so
the host update runs."""

from __future__ import annotations

import copy

import pytest
import torch

import protrain

from .models import batches, build


def _wrapped():
    model = build("llama")
    reference = copy.deepcopy(model)
    wrapped, optimizer, _ = protrain.wrap(
        model, n_persist=0, lr=1e-2, weight_decay=0.01, device="cpu"
    )
    return reference, wrapped, optimizer


def _train_both_and_compare(clear) -> torch.nn.Module:
    """Three steps of torch's AdamW and of the engine, each clearing its gradients with
    ``clear(model, optimizer)`` after the step; the weights agree. The closed wrapped model."""
    reference, model, optimizer = _wrapped()
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.01, fused=True)
    for batch in batches("llama", 3):
        for m, opt in ((reference, ref_opt), (model, optimizer)):
            m(**batch).loss.backward()
            opt.step()
            clear(m, opt)
    state = protrain.state_dict(model)
    for name, value in reference.state_dict().items():
        torch.testing.assert_close(state[name], value, atol=1e-6, rtol=1e-6, msg=name)
    protrain.close(model)
    return model


def test_a_second_clip_before_zero_grad_is_refused():
    _, model, optimizer = _wrapped()
    data = batches("llama", 2)
    model(**data[0]).loss.backward()
    optimizer.clip_grad_norm_(0.05)
    with pytest.raises(RuntimeError, match="clip_grad_norm_ a second time before zero_grad"):
        optimizer.clip_grad_norm_(0.05)
    optimizer.step()
    with pytest.raises(RuntimeError, match="a second time"):  # the same gradient after a step
        optimizer.clip_grad_norm_(0.05)
    optimizer.zero_grad()
    model(**data[1]).loss.backward()
    optimizer.clip_grad_norm_(0.05)  # a new window clips again
    optimizer.step()
    protrain.close(model)


def test_zero_grad_keeping_zeros_trains_as_torch_where_every_parameter_has_a_gradient():
    _train_both_and_compare(lambda m, opt: opt.zero_grad(set_to_none=False))


def test_a_parameter_without_a_gradient_after_zero_grad_keeping_zeros_is_refused():
    """torch would decay it and move it by its moments; the engine names it instead."""
    _, model, optimizer = _wrapped()
    data = batches("llama", 2)
    model(**data[0]).loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=False)
    head = model.lm_head.weight
    head.requires_grad_(False)  # the next backward gives the head no gradient
    model(**data[1]).loss.backward()
    with pytest.raises(RuntimeError, match=r"lm_head.weight .* zero_grad\(set_to_none=False\)"):
        optimizer.step()
    protrain.close(model)


def test_model_zero_grad_clears_the_engine_gradients_as_torch():
    # torch's idiom after step(): the gradients live in the engine's chunks, not in
    # param.grad, and the module's zero_grad clears them there too.
    model = _train_both_and_compare(lambda m, opt: m.zero_grad())
    assert "zero_grad" not in vars(model), "close() leaves the module's own zero_grad"


def test_a_parameter_unfrozen_after_wrap_is_refused_at_step():
    model = build("llama")
    frozen = model.model.layers[0].mlp.up_proj.weight
    frozen.requires_grad_(False)
    model, optimizer, _ = protrain.wrap(model, n_persist=0, lr=1e-2, device="cpu")
    frozen.requires_grad_(True)  # torch's optimizer over it would train it from here on
    model(**batches("llama", 1)[0]).loss.backward()
    with pytest.raises(RuntimeError, match=r"layers\.0\.mlp\.up_proj\.weight .* was frozen"):
        optimizer.step()
    protrain.close(model)


def test_a_bf16_model_computes_in_bf16_and_says_its_masters_are_fp32(caplog):
    plain = build("llama").to(torch.bfloat16)
    batch = batches("llama", 1)[0]
    expected = plain(**batch).loss
    with caplog.at_level("INFO", logger="protrain.engine"):
        model, _, _ = protrain.wrap(copy.deepcopy(plain), n_persist=0, device="cpu")
    assert "bfloat16 are stepped through fp32 masters" in caplog.text
    assert torch.equal(model(**batch).loss, expected)
    protrain.close(model)


def test_a_parameter_unfrozen_under_step_in_backward_is_refused_without_a_half_step():
    model = build("llama")
    frozen = model.model.layers[0].mlp.up_proj.weight
    frozen.requires_grad_(False)
    model, optimizer, _ = protrain.wrap(model, n_persist=0, lr=1e-2, device="cpu")
    batch = batches("llama", 1)[0]
    frozen.requires_grad_(True)
    with pytest.raises(RuntimeError, match="was frozen when protrain.wrap placed it"):
        optimizer.step_in_backward()  # refused before any update begins
    frozen.requires_grad_(False)
    optimizer.step_in_backward()
    frozen.requires_grad_(True)  # unfrozen once the updates are armed
    model(**batch).loss.backward()
    with pytest.raises(RuntimeError, match="this step was taken without it"):
        optimizer.step()
    optimizer.zero_grad()  # the step is complete: the optimizer is usable again
    assert protrain.state_dict(model)  # not "call step() first"
    protrain.close(model)
