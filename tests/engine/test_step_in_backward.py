"""optimizer.step_in_backward(): offloaded chunks start their AdamW inside the last backward
of the window, as soon as their gradients are complete; the result equals plain PyTorch."""

from __future__ import annotations

import copy

import pytest
import torch

import protrain
from protrain.activations import apply_activation_knobs
from protrain.model.blocks import discover_blocks

from .models import batches, build, lora

STEPS, ACCUM, LR, WD = 3, 2, 1e-2, 0.01


def _loss(model, b):
    return model(**b).loss / ACCUM


def _plain(model, data) -> list[float]:
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=LR, weight_decay=WD, fused=True)
    losses = []
    for step in range(STEPS):
        for mb in range(ACCUM):
            loss = _loss(model, data[step * ACCUM + mb])
            loss.backward()
            losses.append(loss.item())
        opt.step()
        opt.zero_grad()
    return losses


def _armed(model, data, optimizer, sched=None) -> list[float]:
    losses = []
    for step in range(STEPS):
        for mb in range(ACCUM):
            if mb == ACCUM - 1:
                optimizer.step_in_backward()
            loss = _loss(model, data[step * ACCUM + mb])
            loss.backward()
            losses.append(loss.item())
        optimizer.step()
        if sched is not None:
            sched.step()
        optimizer.zero_grad()
    return losses


def _n_chunks(model) -> int:
    _, opt, layout = protrain.wrap(copy.deepcopy(model), device="cpu")
    opt.close()
    return layout.n_chunks


@pytest.mark.parametrize(
    "checkpoint,piece_numel", [(False, None), (True, None), (True, 100)]
)  # piece_numel: host updates in pieces, copied in piece by piece by the next forward
@pytest.mark.parametrize("mode", ["full", "lora"])
@pytest.mark.parametrize("kind", ["llama", "gpt2", "t5"])
def test_same_as_plain_pytorch(kind, mode, checkpoint, piece_numel, monkeypatch):
    if piece_numel is not None:
        monkeypatch.setattr("protrain.optim.hybrid_adamw._UPDATE_PIECE_NUMEL", piece_numel)
    base = build(kind)
    if mode == "lora":
        base = lora(base, kind)
    data = batches(kind, STEPS * ACCUM)
    reference = copy.deepcopy(base)
    ref_losses = _plain(reference, data)
    n_chunks = _n_chunks(base)
    for n_persist in sorted({0, n_chunks // 2}):
        model, optimizer, layout = protrain.wrap(
            copy.deepcopy(base), n_persist=n_persist, lr=LR, weight_decay=WD, device="cpu"
        )
        if checkpoint:  # recomputation re-gathers chunks whose update may have begun
            n_blocks = len(discover_blocks(model).blocks)
            apply_activation_knobs(model, n_swap=0, n_checkpoint=n_blocks, device="cpu")
        losses = _armed(model, data, optimizer)
        assert losses == pytest.approx(ref_losses, abs=1e-6, rel=1e-6), (kind, n_persist)
        # updates did start inside backward: every offloaded chunk with gradients, each step
        n_offloaded = sum(
            1 for c in layout.chunks[n_persist:] if any(p.trainable for p in c.placements)
        )
        assert n_offloaded > 0
        assert optimizer.stats.get("updates_started_in_backward", 0) == STEPS * n_offloaded
        state = protrain.state_dict(model)
        for name, ref in reference.state_dict().items():
            torch.testing.assert_close(
                state[name], ref, atol=1e-6, rtol=0, msg=f"{kind} {mode} n={n_persist} {name}"
            )
        protrain.close(model)


def test_lr_scheduler_between_steps_is_exact():
    base = build("llama")
    data = batches("llama", STEPS * ACCUM)
    reference = copy.deepcopy(base)
    params = [p for p in reference.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=LR, weight_decay=WD, fused=True)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    for step in range(STEPS):
        for mb in range(ACCUM):
            _loss(reference, data[step * ACCUM + mb]).backward()
        opt.step()
        sched.step()
        opt.zero_grad()
    model, optimizer, _ = protrain.wrap(
        copy.deepcopy(base), n_persist=0, lr=LR, weight_decay=WD, device="cpu"
    )
    _armed(model, data, optimizer, torch.optim.lr_scheduler.StepLR(optimizer, 1, gamma=0.5))
    state = protrain.state_dict(model)
    for name, ref in reference.state_dict().items():
        torch.testing.assert_close(state[name], ref, atol=1e-6, rtol=0, msg=name)
    protrain.close(model)


def _wrapped():
    base = build("llama")
    model, optimizer, _ = protrain.wrap(base, n_persist=0, lr=LR, device="cpu")
    return model, optimizer, batches("llama", 2)


def test_clipping_after_arming_is_an_error():
    model, optimizer, data = _wrapped()
    optimizer.step_in_backward()
    model(**data[0]).loss.backward()
    with pytest.raises(RuntimeError, match="clipping needs every gradient"):
        optimizer.clip_grad_norm_(1.0)
    optimizer.step()  # the armed step still completes
    protrain.close(model)


def test_arming_two_backwards_is_an_error():
    model, optimizer, data = _wrapped()
    optimizer.step_in_backward()
    model(**data[0]).loss.backward()
    with pytest.raises(RuntimeError, match="second gradient"):
        model(**data[1]).loss.backward()
    protrain.close(model)


def test_changed_lr_and_zero_grad_before_step_are_errors():
    model, optimizer, data = _wrapped()
    optimizer.step_in_backward()
    model(**data[0]).loss.backward()
    with pytest.raises(RuntimeError, match="call step\\(\\) first"):
        optimizer.zero_grad()
    optimizer.param_groups[0]["lr"] = LR / 2
    with pytest.raises(RuntimeError, match="hyperparameter changed"):
        optimizer.step()
    protrain.close(model)


def test_not_with_fp16_loss_scaling():
    model, optimizer, _ = protrain.wrap(
        build("llama"), n_persist=0, device="cpu", compute_dtype=torch.float16
    )
    with pytest.raises(RuntimeError, match="fp16 loss scaling"):
        optimizer.step_in_backward()
    protrain.close(model)


def test_a_refused_step_leaves_forward_and_masters_in_agreement():
    """step() refuses a changed hyperparameter after updates began in backward; the chunks
    updated there keep their update, and the next forward computes with it."""
    base = build("llama")
    data = batches("llama", 2)
    model, optimizer, _ = protrain.wrap(copy.deepcopy(base), n_persist=0, lr=LR, device="cpu")
    optimizer.step_in_backward()
    model(**data[0]).loss.backward()
    optimizer.param_groups[0]["lr"] = LR / 2
    with pytest.raises(RuntimeError, match="hyperparameter changed"):
        optimizer.step()
    optimizer.zero_grad()
    with torch.no_grad():
        loss = model(**data[1]).loss
    state = protrain.state_dict(model)
    protrain.close(model)
    plain = copy.deepcopy(base)
    plain.load_state_dict(state)
    with torch.no_grad():
        expected = plain(**data[1]).loss
    assert loss.item() == pytest.approx(expected.item(), abs=1e-6)


def test_state_between_an_armed_backward_and_step_is_an_error():
    """Between an armed backward and step() the offloaded chunks are stepped and the rest
    not: no state of that moment is a state plain PyTorch could have, so saving or loading
    it is refused until step() completes the update."""
    model, optimizer, data = _wrapped()
    optimizer.step_in_backward()
    model(**data[0]).loss.backward()
    for call in (
        lambda: protrain.state_dict(model),
        lambda: protrain.load_state_dict(model, {}),
        optimizer.state_dict,
        lambda: optimizer.load_state_dict({}),
    ):
        with pytest.raises(RuntimeError, match="call step\\(\\) first"):
            call()
    optimizer.step()
    optimizer.load_state_dict(optimizer.state_dict())
    protrain.load_state_dict(model, protrain.state_dict(model))
    protrain.close(model)


def test_close_between_an_armed_backward_and_step_warns_and_gives_back(caplog):
    import logging

    from protrain.chunks.manager import registered_host_bytes

    model, optimizer, data = _wrapped()
    optimizer.step_in_backward()
    model(**data[0]).loss.backward()
    with caplog.at_level(logging.WARNING, logger="protrain.engine"):
        protrain.close(model)
    assert "half stepped" in caplog.text
    assert getattr(model, "_protrain_engine", None) is None
    assert registered_host_bytes() == 0


def test_a_piece_starts_before_the_rest_of_its_chunk_has_gradients(monkeypatch):
    """Updates start per piece ([Note: chunks complete in backward]): the host steps a chunk's
    last layers while backward still computes the gradients of its first ones."""
    from protrain.optim.hybrid_adamw import HybridAdamW

    monkeypatch.setattr("protrain.optim.hybrid_adamw._UPDATE_PIECE_NUMEL", 100)
    missing_at_start = []
    original = HybridAdamW._start_in_backward

    def spy(self, key):
        chunk = self._manager.chunks[key[0]]
        missing_at_start.append(sum(not s.has_grad for s in chunk.trainable_slots))
        return original(self, key)

    monkeypatch.setattr(HybridAdamW, "_start_in_backward", spy)
    model, optimizer, data = _wrapped()
    optimizer.step_in_backward()
    model(**data[0]).loss.backward()
    optimizer.step()
    assert len(missing_at_start) > optimizer.stats["updates_started_in_backward"]
    assert max(missing_at_start) > 0  # a piece began while its chunk still missed gradients
    protrain.close(model)


def test_a_parameter_without_gradient_is_left_alone(monkeypatch):
    """A piece whose parameter gets no gradient never completes in backward; step() queues
    it, and it stays unchanged, as under torch's AdamW."""
    monkeypatch.setattr("protrain.optim.hybrid_adamw._UPDATE_PIECE_NUMEL", 100)
    base = build("llama")
    base.unused = torch.nn.Linear(8, 8)  # registered last: in the last chunk, never used
    data = batches("llama", STEPS * ACCUM)
    reference = copy.deepcopy(base)
    ref_losses = _plain(reference, data)
    model, optimizer, _ = protrain.wrap(
        copy.deepcopy(base), n_persist=0, lr=LR, weight_decay=WD, device="cpu"
    )
    assert _armed(model, data, optimizer) == pytest.approx(ref_losses, abs=1e-6, rel=1e-6)
    state = protrain.state_dict(model)
    for name, ref in reference.state_dict().items():
        torch.testing.assert_close(state[name], ref, atol=1e-6, rtol=0, msg=name)
    torch.testing.assert_close(state["unused.weight"], base.unused.weight, atol=0, rtol=0)
    protrain.close(model)


@pytest.mark.parametrize("how", ["unused parameter", "backward raised"])
def test_close_with_an_update_begun_in_part_does_not_hang(how, monkeypatch):
    """Pieces that no gradient completed are queued only by step(); close() without step()
    completes such an update with those pieces unchanged instead of waiting for them."""
    import threading

    monkeypatch.setattr("protrain.optim.hybrid_adamw._UPDATE_PIECE_NUMEL", 100)
    base = build("llama")
    base.unused = torch.nn.Linear(8, 8)
    model, optimizer, _ = protrain.wrap(base, n_persist=0, lr=LR, device="cpu")
    data = batches("llama", 1)
    blocks = discover_blocks(model).blocks
    if how == "backward raised":  # after the last blocks' pieces began, before the first's

        def boom(module, grad_input, grad_output):
            raise RuntimeError("boom")

        blocks[0].module.register_full_backward_hook(boom)
    optimizer.step_in_backward()
    try:
        model(**data[0]).loss.backward()
    except RuntimeError as e:
        assert "boom" in str(e)
    assert optimizer.stats["updates_started_in_backward"] > 0
    closer = threading.Thread(target=protrain.close, args=(model,), daemon=True)
    closer.start()
    closer.join(timeout=60)
    assert not closer.is_alive(), "close() hung on an update begun in backward"
    assert getattr(model, "_protrain_engine", None) is None


def test_step_retried_after_a_refused_hyperparameter_steps_each_piece_once(monkeypatch):
    """step() refuses a changed hyperparameter after pieces began in backward; with the
    value restored, a retried step() steps only what had not begun: one AdamW step in all,
    as plain PyTorch takes."""
    monkeypatch.setattr("protrain.optim.hybrid_adamw._UPDATE_PIECE_NUMEL", 100)
    base = build("llama")
    data = batches("llama", 1)
    reference = copy.deepcopy(base)
    params = [p for p in reference.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=LR, weight_decay=WD, fused=True)
    reference(**data[0]).loss.backward()
    opt.step()
    n_chunks = _n_chunks(base)
    model, optimizer, _ = protrain.wrap(
        copy.deepcopy(base), n_persist=n_chunks // 2, lr=LR, weight_decay=WD, device="cpu"
    )
    optimizer.step_in_backward()
    model(**data[0]).loss.backward()
    optimizer.param_groups[0]["lr"] = LR / 2
    with pytest.raises(RuntimeError, match="hyperparameter changed"):
        optimizer.step()
    optimizer.param_groups[0]["lr"] = LR
    optimizer.step()
    state = protrain.state_dict(model)
    for name, ref in reference.state_dict().items():
        torch.testing.assert_close(state[name], ref, atol=1e-6, rtol=0, msg=name)
    protrain.close(model)
