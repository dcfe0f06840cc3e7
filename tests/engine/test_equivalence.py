"""The engine computes what plain PyTorch computes (fp32 on CPU: to 1e-6).

N steps of gradient accumulation 2 with global-norm clipping, through the engine with
n_persist at 0, half and all chunks, against the same model trained with plain
``torch.optim.AdamW`` and ``torch.nn.utils.clip_grad_norm_``.
"""

from __future__ import annotations

import copy

import pytest
import torch

import protrain

from .models import batches, build, lora

STEPS, ACCUM, MAX_NORM, LR, WD = 3, 2, 0.5, 1e-2, 0.01
KINDS = ["llama", "qwen2", "mistral", "gpt2", "t5", "llava"]


def _loss(model, b):
    return model(**b).loss / ACCUM


def train_plain(model, data):
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=LR, weight_decay=WD, fused=True)
    losses, norms = [], []
    for step in range(STEPS):
        for mb in range(ACCUM):
            loss = _loss(model, data[step * ACCUM + mb])
            loss.backward()
            losses.append(loss.item())
        norms.append(torch.nn.utils.clip_grad_norm_(params, MAX_NORM).item())
        opt.step()
        opt.zero_grad()
    return losses, norms


def train_engine(model, data, optimizer):
    losses, norms = [], []
    for step in range(STEPS):
        for mb in range(ACCUM):
            loss = _loss(model, data[step * ACCUM + mb])
            loss.backward()
            losses.append(loss.item())
        norms.append(optimizer.clip_grad_norm_(MAX_NORM).item())
        optimizer.step()
        optimizer.zero_grad()
    return losses, norms


def _n_chunks(model) -> int:
    m, opt, layout = protrain.wrap(copy.deepcopy(model), device="cpu")
    n = layout.n_chunks
    opt.close()
    return n


@pytest.mark.parametrize("mode", ["full", "lora"])
@pytest.mark.parametrize("kind", KINDS)
def test_same_losses_and_parameters_as_plain_pytorch(kind, mode):
    base = build(kind)
    if mode == "lora":
        base = lora(base, kind)
    data = batches(kind, STEPS * ACCUM)
    reference = copy.deepcopy(base)
    ref_losses, ref_norms = train_plain(reference, data)
    ref_state = reference.state_dict()

    n_chunks = _n_chunks(base)
    assert n_chunks >= 3, f"{kind}: want several chunks, got {n_chunks}"
    for n_persist in sorted({0, n_chunks // 2, n_chunks}):
        model, optimizer, layout = protrain.wrap(
            copy.deepcopy(base), n_persist=n_persist, lr=LR, weight_decay=WD, device="cpu"
        )
        losses, norms = train_engine(model, data, optimizer)
        assert losses == pytest.approx(ref_losses, abs=1e-6, rel=1e-6), (kind, n_persist)
        assert norms == pytest.approx(ref_norms, abs=1e-6, rel=1e-6), (kind, n_persist)
        state = protrain.state_dict(model)
        assert state.keys() == ref_state.keys()
        for name, ref in ref_state.items():
            torch.testing.assert_close(
                state[name], ref, atol=1e-6, rtol=0, msg=f"{kind} n_persist={n_persist} {name}"
            )
        protrain.close(model)


@pytest.mark.parametrize("piece_numel", [None, 100])
@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_same_parameters_without_clipping(kind, piece_numel, monkeypatch):
    """Without clipping the host steps may start before the whole backward ends: same
    result. With ``piece_numel`` every chunk's host update runs in many pieces (each tensor
    of these tiny models is a piece of its own), which the next forward's gathers copy in
    one at a time."""
    if piece_numel is not None:
        monkeypatch.setattr("protrain.optim.hybrid_adamw._UPDATE_PIECE_NUMEL", piece_numel)
    torch.manual_seed(0)
    base = build(kind)
    data = batches(kind, STEPS * ACCUM)
    reference = copy.deepcopy(base)
    params = [p for p in reference.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=LR, weight_decay=WD, fused=True)
    for step in range(STEPS):
        for mb in range(ACCUM):
            _loss(reference, data[step * ACCUM + mb]).backward()
        opt.step()
        opt.zero_grad()
    n_chunks = _n_chunks(base)
    for n_persist in (0, n_chunks // 2):
        model, optimizer, _ = protrain.wrap(
            copy.deepcopy(base), n_persist=n_persist, lr=LR, weight_decay=WD, device="cpu"
        )
        for step in range(STEPS):
            for mb in range(ACCUM):
                _loss(model, data[step * ACCUM + mb]).backward()
            optimizer.step()
            optimizer.zero_grad()
        state = protrain.state_dict(model)
        for name, ref in reference.state_dict().items():
            torch.testing.assert_close(
                state[name], ref, atol=1e-6, rtol=0, msg=f"{kind} n_persist={n_persist} {name}"
            )
        protrain.close(model)


@pytest.mark.parametrize("mode", ["full", "lora"])
def test_updates_in_pieces_with_clipping(mode, monkeypatch):
    """Clipped steps with each host update split into pieces: the same as plain PyTorch."""
    monkeypatch.setattr("protrain.optim.hybrid_adamw._UPDATE_PIECE_NUMEL", 100)
    base = build("llama")
    if mode == "lora":
        base = lora(base, "llama")
    data = batches("llama", STEPS * ACCUM)
    reference = copy.deepcopy(base)
    ref_losses, ref_norms = train_plain(reference, data)
    model, optimizer, _ = protrain.wrap(
        copy.deepcopy(base), n_persist=1, lr=LR, weight_decay=WD, device="cpu"
    )
    pieces = [len(p) for p in optimizer._host_opts.values()]
    assert max(pieces) > 1, pieces
    losses, norms = train_engine(model, data, optimizer)
    assert losses == pytest.approx(ref_losses, abs=1e-6, rel=1e-6)
    assert norms == pytest.approx(ref_norms, abs=1e-6, rel=1e-6)
    state = protrain.state_dict(model)
    for name, ref in reference.state_dict().items():
        torch.testing.assert_close(state[name], ref, atol=1e-6, rtol=0, msg=name)
    # the optimizer state round-trips through per-piece instances
    saved = optimizer.state_dict()
    optimizer.load_state_dict(saved)
    again = optimizer.state_dict()
    for k, st in saved["state"].items():
        for name, v in st.items():
            torch.testing.assert_close(again["state"][k][name], v, atol=0, rtol=0)
    protrain.close(model)


def test_two_steps_in_a_row_then_forward(monkeypatch):
    """``step(); step()`` before the next forward (legal in torch): the forward sees the
    second update, not pieces of the first (each update has its own progress)."""
    monkeypatch.setattr("protrain.optim.hybrid_adamw._UPDATE_PIECE_NUMEL", 100)
    base = build("llama")
    data = batches("llama", 2)
    reference = copy.deepcopy(base)
    opt = torch.optim.AdamW(reference.parameters(), lr=LR, weight_decay=WD, fused=True)
    reference(**data[0]).loss.backward()
    opt.step()
    opt.step()
    with torch.no_grad():
        expected = reference(**data[1]).loss.item()
    model, optimizer, _ = protrain.wrap(
        copy.deepcopy(base), n_persist=0, lr=LR, weight_decay=WD, device="cpu"
    )
    model(**data[0]).loss.backward()
    optimizer.step()
    optimizer.step()
    with torch.no_grad():
        assert model(**data[1]).loss.item() == pytest.approx(expected, abs=1e-6, rel=1e-6)
    protrain.close(model)


def test_a_failed_host_update_is_raised_at_every_gather(monkeypatch):
    """A host AdamW that fails halfway: the gather that waits for it raises its error and
    leaves the chunk released (no device bytes, not counted as resident); so does the next."""
    import protrain.optim.hybrid_adamw as hybrid

    monkeypatch.setattr(hybrid, "_UPDATE_PIECE_NUMEL", 100)
    calls = [0]

    def fails_second_piece(real):  # on whichever host path runs: the one pass or torch's
        def piece(*args, **kwargs):
            calls[0] += 1
            if calls[0] == 2:
                raise RuntimeError("injected host AdamW failure")
            return real(*args, **kwargs)

        return piece

    for name in ("_step_host_piece", "_step_one_pass"):
        monkeypatch.setattr(hybrid, name, fails_second_piece(getattr(hybrid, name)))
    data = batches("llama", 2)
    model, optimizer, _ = protrain.wrap(build("llama"), n_persist=0, lr=LR, device="cpu")
    model(**data[0]).loss.backward()
    optimizer.step()
    manager = model._protrain_engine.manager
    for _ in range(2):
        with pytest.raises(RuntimeError, match="injected host AdamW failure"), torch.no_grad():
            model(**data[1])
        chunk = manager.chunks[manager.forward_order[0]]
        assert chunk.index not in manager.resident
        assert chunk.device_buffer.untyped_storage().nbytes() == 0
    # close() gives everything back and still reports the failed update
    with pytest.raises(RuntimeError, match="injected host AdamW failure"):
        protrain.close(model)
    assert not hasattr(model, "_protrain_engine")


@pytest.mark.parametrize("n_buffer", [4, 5])
def test_chunks_kept_through_a_step_never_serve_old_weights(n_buffer):
    """The step keeps resident chunks and refreshes them at their next gather; a chunk a
    prefetch brought in but no module used (micro-batches that take different paths: images
    in one, text in the other) is released instead, or the next forward would read its old
    weights (without that, a no-grad loss is 1.9e-4 off plain PyTorch)."""
    base = build("llava")
    images = batches("llava", 6)
    text = [
        {"input_ids": b["input_ids"].clamp(max=90), "labels": b["input_ids"].clamp(max=90)}
        for b in batches("llama", 6, seed=5)
    ]
    windows = [
        (images[0], text[0]), (text[3], images[1]), (images[2], text[2]), (text[4], images[3])
    ]  # fmt: skip

    def run(model, step, zero_grad):
        losses = []
        for window in windows:
            for b in window:
                loss = model(**b).loss / 2
                loss.backward()
                losses.append(loss.item())
            step()
            zero_grad()
            with torch.no_grad():
                losses.append(model(**images[5]).loss.item())
        return losses

    reference = copy.deepcopy(base)
    params = [p for p in reference.parameters() if p.requires_grad]
    plain = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.01, fused=True)
    want = run(reference, plain.step, plain.zero_grad)
    model, opt, _ = protrain.wrap(
        copy.deepcopy(base), n_persist=0, n_buffer=n_buffer, lr=1e-2, weight_decay=0.01,
        device="cpu",
    )  # fmt: skip
    got = run(model, opt.step, opt.zero_grad)
    assert got == pytest.approx(want, abs=1e-6)
    state = protrain.state_dict(model)
    for name, value in reference.state_dict().items():
        torch.testing.assert_close(state[name], value, atol=1e-6, rtol=0)
    protrain.close(model)
