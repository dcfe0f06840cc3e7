"""Swap bookkeeping on the CPU: what is swapped, what is shared, how much comes back at once."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from protrain.activations import ActivationSwapper, apply_activation_policies
from protrain.activations.swap import _Packed

from .models import batches, build


def test_parameters_and_their_views_are_not_swapped():
    swapper = ActivationSwapper("cpu")
    group = swapper.open_group()
    w = nn.Parameter(torch.randn(4, 3))
    frozen = nn.Parameter(torch.randn(4, 3), requires_grad=False)
    x = torch.randn(2, 4)
    assert swapper.pack(group, w) is w
    view = w.t()
    assert swapper.pack(group, view) is view
    assert swapper.pack(group, frozen) is frozen
    assert isinstance(swapper.pack(group, x), _Packed)


def test_views_of_one_storage_share_one_host_copy():
    swapper = ActivationSwapper("cpu")
    group = swapper.open_group()
    x = torch.randn(6, 4)
    packed = [swapper.pack(group, v) for v in (x, x.t(), x[2:4], x.view(24))]
    swapper.close_group(group, None)
    assert len(group.copies) == 1 and swapper.transfer.bytes_to_host == x.numel() * 4
    for p, v in zip(packed, (x, x.t(), x[2:4], x.view(24))):
        out = swapper.unpack(p)
        assert out.shape == v.shape and out.stride() == v.stride() and torch.equal(out, v)
    assert swapper.transfer.device_bytes == 0  # released after the last unpack


@pytest.mark.parametrize("prefetch_groups", [0, 1, 2])
def test_at_most_prefetch_groups_plus_one_on_the_device(prefetch_groups):
    model = build("llama", num_hidden_layers=6)
    data = batches(1)[0]
    handle = apply_activation_policies(
        model, ["swap"] * 6, device="cpu", swap_prefetch_groups=prefetch_groups
    )
    transfer = handle.swapper.transfer
    model(**data).loss.backward()
    per_block = transfer.bytes_to_host // 6
    assert transfer.bytes_to_host == 6 * per_block  # every block swaps the same
    assert transfer.peak_device_bytes <= (prefetch_groups + 1) * per_block
    assert transfer.peak_device_bytes > prefetch_groups * per_block
    assert transfer.device_bytes == 0 and transfer.bytes_to_device == transfer.bytes_to_host
    handle.remove()


def test_backward_twice_with_retain_graph():
    base = build("llama")
    data = batches(1)[0]
    ref = copy.deepcopy(base)
    loss = ref(**data).loss
    loss.backward(retain_graph=True)
    loss.backward()
    model = copy.deepcopy(base)
    handle = apply_activation_policies(model, ["swap", "offload_checkpoint", "swap", "keep"])
    loss = model(**data).loss
    loss.backward(retain_graph=True)
    loss.backward()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, atol=1e-6, rtol=0, msg=name)
    handle.remove()


def test_offload_checkpoint_holds_only_the_hidden_states():
    model = build("llama")
    data = batches(1)[0]  # batch 2 x 12 tokens, hidden 32, fp32
    handle = apply_activation_policies(model, ["offload_checkpoint"] * 4, device="cpu")
    model(**data).loss.backward()
    assert handle.swapper.transfer.bytes_to_host == 4 * 2 * 12 * 32 * 4
    handle.remove()


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_outputs_saved_by_their_own_op_come_back_right(attn):
    """Eager attention's softmax saves its own output; the unpacked copy must serve it."""
    base = build("llama", attn_implementation=attn)
    data = batches(1)[0]
    ref = copy.deepcopy(base)
    ref(**data).loss.backward()
    model = copy.deepcopy(base)
    handle = apply_activation_policies(model, ["swap", "offload_checkpoint"] * 2, device="cpu")
    model(**data).loss.backward()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, atol=1e-6, rtol=0, msg=name)
    handle.remove()


@pytest.mark.parametrize(
    "policy, inputs_alive",
    [("keep", 4), ("checkpoint", 4), ("swap", 0), ("offload_checkpoint", 0)],
)
def test_what_stays_alive_between_forward_and_backward(policy, inputs_alive):
    """Block inputs after forward: kept by keep (RMSNorm saves them) and by checkpoint (it
    holds them for the recomputation); freed by swap and offload-checkpoint (host copies)."""
    import weakref

    model = build("llama")
    data = {**batches(1)[0], "use_cache": False}
    refs = []
    for layer in model.model.layers:
        layer.register_forward_pre_hook(
            lambda m, args, kwargs: refs.append(
                weakref.ref(args[0] if args else kwargs["hidden_states"])
            ),
            with_kwargs=True,
        )
    handle = apply_activation_policies(model, [policy] * 4, device="cpu")
    loss = model(**data).loss
    assert sum(r() is not None for r in refs) == inputs_alive
    loss.backward()
    handle.remove()


def test_copies_to_the_host_in_flight_are_bounded():
    """The bound on copies in flight (CUDA events, faked here): the oldest is waited for."""
    from protrain.activations.transfer import HostTransfer

    class FakeEvent:
        def __init__(self):
            self.done, self.waited = False, False

        def query(self):
            return self.done

        def synchronize(self):
            self.waited = self.done = True

    transfer = HostTransfer("cpu", max_in_flight_bytes=100)
    events = [FakeEvent() for _ in range(4)]
    for e in events:
        transfer._in_flight.append((e, 40))
        transfer._in_flight_bytes += 40
        transfer._retire_in_flight()
    # 40, 80 fit; at 120 the oldest is waited for (80 left), at 120 again the next one
    assert [e.waited for e in events] == [True, True, False, False]
    assert transfer._in_flight_bytes == 80
    events[2].done = True  # completed copies are retired without waiting
    transfer._retire_in_flight()
    assert transfer._in_flight_bytes == 40 and not events[2].waited


def test_host_piece_sizes_are_binary_digits_down_to_the_smallest_piece():
    from protrain.activations.transfer import host_piece_sizes

    assert host_piece_sizes(0, 64) == [0]
    assert host_piece_sizes(64, 64) == [64]
    assert host_piece_sizes(3 << 30, 64 << 20) == [2 << 30, 1 << 30]  # not one 4 GiB piece
    for n in (65, 100, 1000, 4096, 12345, 3 * 2**20 + 7):
        sizes = host_piece_sizes(n, 64)
        *digits, last = sizes
        assert sum(sizes) == n and digits == sorted(digits, reverse=True)
        assert all(s & (s - 1) == 0 for s in digits)  # powers of two, largest first
        assert last <= 64 or last & (last - 1) == 0  # then the rest, if any


def test_a_copy_in_pieces_comes_back_whole():
    """Swap and offload-checkpoint with every storage in small host pieces: same gradients."""
    from protrain.activations.transfer import HostTransfer

    base = build("llama")
    data = batches(1)[0]
    ref = copy.deepcopy(base)
    ref(**data).loss.backward()
    model = copy.deepcopy(base)
    handle = apply_activation_policies(model, ["swap", "offload_checkpoint", "swap", "keep"])
    transfer = HostTransfer("cpu", min_piece_bytes=96)
    handle.swapper.transfer = transfer
    model(**data).loss.backward()
    assert transfer.bytes_to_host > 0 and transfer.bytes_to_device == transfer.bytes_to_host
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, atol=1e-6, rtol=0, msg=name)
    handle.remove()
