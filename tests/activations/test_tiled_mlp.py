"""Tiled MLP: the same function, its intermediates never over the whole sequence at once."""

from __future__ import annotations

import copy
import os
import tempfile

import pytest
import torch

from protrain.activations import apply_activation_policies, apply_tiled_mlp, place_policies

from .memory import LargestOutputs
from .models import (
    ACCUM,
    STEPS,
    assert_same_gradients,
    batches,
    build,
    first_gradients,
    lora,
    train,
)

SEQ, TILE = 12, 5  # ragged last tile


def _grads(model, data):
    loss = model(**data).loss
    loss.backward()
    return loss.item(), {
        n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None
    }


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_same_loss_and_gradients(kind):
    base = build(kind)
    data = batches(1, seq=SEQ)[0]
    ref_loss, ref_grads = _grads(copy.deepcopy(base), data)
    model = copy.deepcopy(base)
    handle = apply_tiled_mlp(model, tile_tokens=TILE)
    assert handle.mlp_names == [f"model.layers.{i}.mlp" for i in range(4)]
    loss, grads = _grads(model, data)
    assert loss == pytest.approx(ref_loss, abs=1e-6)
    assert grads.keys() == ref_grads.keys()
    for name, g in ref_grads.items():
        torch.testing.assert_close(grads[name], g, atol=1e-6, rtol=1e-6, msg=name)
    handle.remove()
    assert all("forward" not in layer.mlp.__dict__ for layer in model.model.layers)


@pytest.mark.exactness
@pytest.mark.parametrize("mode", ["full", "lora"])
def test_trains_like_plain_pytorch_with_policies(mode):
    """Composed with a mix of policies and gradient accumulation.

    Losses and the gradients before a step agree with plain PyTorch to 1e-6. A tile sums
    its weight gradient over fewer tokens, so torch's matmul kernels round the fp32 sums in
    another order (which also follows the CPU's vector width: 3e-8 here), and AdamW's first
    steps turn a near-zero gradient's last bits into updates of up to ``lr``. So the weights
    after the steps are compared with the same tiles without the policies: bit for bit.
    """
    base = build("llama")
    if mode == "lora":
        base = lora(base)
    data = batches(STEPS * ACCUM, seq=SEQ)
    policies = ["swap", "offload_checkpoint", "checkpoint", "keep"]
    plain_grads = first_gradients(copy.deepcopy(base), data[0])
    model = copy.deepcopy(base)
    handle = apply_activation_policies(model, policies, device="cpu", tiled_mlp_tokens=TILE)
    assert_same_gradients(first_gradients(model, data[0]), plain_grads)
    plain_losses = train(copy.deepcopy(base), data)
    reference = copy.deepcopy(base)
    apply_tiled_mlp(reference, tile_tokens=TILE)
    train(reference, data)
    losses = train(model, data)
    assert losses == pytest.approx(plain_losses, abs=1e-6, rel=1e-6)
    ref_state = reference.state_dict()
    for name, value in model.state_dict().items():
        torch.testing.assert_close(value, ref_state[name], atol=0, rtol=0, msg=name)
    handle.remove()


def test_intermediates_exist_one_tile_at_a_time():
    hidden, intermediate, batch, seq, tile = 32, 64, 2, 40, 8
    model = build("llama")
    data = batches(1, seq=seq, batch=batch)[0]
    mlp = model.model.layers[0].mlp
    x = torch.randn(batch, seq, hidden, requires_grad=True)

    def largest_intermediate(module):
        with LargestOutputs() as watch:
            module(x).sum().backward()
        return watch.largest[torch.float32]

    assert largest_intermediate(mlp) == batch * seq * intermediate
    apply_tiled_mlp(model, tile_tokens=tile)
    # left: a tile's intermediates, the MLP's input and output (and their gradients), weights
    assert largest_intermediate(mlp) == max(
        batch * tile * intermediate, batch * seq * hidden, hidden * intermediate
    )
    model(**data).loss.backward()  # and the whole model still runs


def test_no_grad_tiles_too():
    model = build("llama")
    mlp = model.model.layers[0].mlp
    x = torch.randn(2, 40, 32)
    with torch.no_grad():
        ref = mlp(x)
        apply_tiled_mlp(model, tile_tokens=8)
        with LargestOutputs() as watch:
            out = mlp(x)
    torch.testing.assert_close(out, ref, atol=1e-6, rtol=0)
    assert watch.largest[torch.float32] == max(2 * 8 * 64, 2 * 40 * 32)


def test_errors():
    model = build("llama")
    with pytest.raises(ValueError, match="tile_tokens"):
        apply_tiled_mlp(model, tile_tokens=0)
    with pytest.raises(ValueError, match="has no child named"):
        apply_tiled_mlp(model, tile_tokens=4, mlp_names=("feed_forward",))
    assert all("forward" not in layer.mlp.__dict__ for layer in model.model.layers)


def _fsdp_worker(rank: int, world_size: int, init_file: str, results) -> None:
    """One rank: FSDP2 per decoder layer, with and without tiles; count the collectives."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size
    )
    counts = {"all_gather": 0, "reduce_scatter": 0}
    all_gather, reduce_scatter = dist.all_gather_single, dist.reduce_scatter_single

    def counted_all_gather(*a, **k):
        counts["all_gather"] += 1
        return all_gather(*a, **k)

    def counted_reduce_scatter(*a, **k):
        counts["reduce_scatter"] += 1
        return reduce_scatter(*a, **k)

    dist.all_gather_single, dist.reduce_scatter_single = counted_all_gather, counted_reduce_scatter
    out = {}
    for tiled in (False, True):
        model = build("llama")
        if tiled:
            apply_tiled_mlp(model, tile_tokens=TILE)
        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
        data = batches(1, seq=SEQ, seed=10 + rank)[0]
        counts.update(all_gather=0, reduce_scatter=0)
        loss = model(**data).loss
        loss.backward()
        grads = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
        out[tiled] = (loss.item(), dict(counts), grads)
    dist.destroy_process_group()
    results[rank] = (
        out[False][0] - out[True][0],
        out[False][1],
        out[True][1],
        max((out[False][2][n] - out[True][2][n]).abs().max().item() for n in out[False][2]),
    )


@pytest.mark.slow
def test_fsdp2_two_ranks_same_collectives_and_result():
    """Under FSDP2 (gloo, 2 ranks on the CPU) tiles add no all-gather and no reduce-scatter."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as d:
        manager = mp.Manager()
        results = manager.dict()
        mp.spawn(_fsdp_worker, args=(2, os.path.join(d, "init"), results), nprocs=2, join=True)
        for rank in range(2):
            loss_diff, plain_counts, tiled_counts, grad_diff = results[rank]
            assert plain_counts["all_gather"] > 0
            assert tiled_counts == plain_counts, rank
            assert abs(loss_diff) < 1e-6 and grad_diff < 1e-6, rank


def test_fsdp_unit_inside_the_mlp_is_refused(tmp_path):
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/init", rank=0, world_size=1)
    try:
        model = build("llama")
        fully_shard(model.model.layers[0].mlp.up_proj)
        with pytest.raises(ValueError, match="would all-gather once per tile"):
            apply_tiled_mlp(model, tile_tokens=TILE)
    finally:
        dist.destroy_process_group()


def test_policy_rule_with_tiles_runs_no_collectives_without_a_process_group():
    import torch.distributed as dist

    assert not dist.is_initialized()
    model = build("llama")
    apply_activation_policies(model, place_policies(4, 1, 2), device="cpu", tiled_mlp_tokens=TILE)
    model(**batches(1, seq=SEQ)[0]).loss.backward()
    assert not dist.is_initialized()


def test_an_mlp_returning_more_than_a_tensor_is_refused():
    class RouterMLP(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Linear(8, 8)

        def forward(self, x):
            return self.proj(x), x.sum(-1)

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.mlp = RouterMLP()

        def forward(self, x):
            return self.mlp(x)[0]

    model = torch.nn.Sequential(Block(), Block())
    apply_tiled_mlp(model, tile_tokens=2)
    with pytest.raises(TypeError, match="do not tile this model's MLP"):
        model(torch.randn(1, 5, 8))


def test_norms_are_tiled_too():
    """The blocks' norms and the final norm run over tiles: the same values and gradients,
    and the fp32 copies of RMSNorm's backward exist for one tile at a time (the step's peak
    at long sequences; see [Note: tiled norms])."""
    from protrain.profile.memory_clock import TensorBytesCounter

    model = build("llama")
    handle = apply_tiled_mlp(model, tile_tokens=8)
    assert handle.norm_names == [
        f"model.layers.{i}.{n}" for i in range(4) for n in ("input_layernorm", "post_attention_layernorm")
    ] + ["model.norm"]  # fmt: skip
    handle.remove()
    norm = model.model.layers[0].input_layernorm
    x = torch.randn(2, 64, 32, dtype=torch.bfloat16, requires_grad=True)
    norm.to(torch.bfloat16)

    def run():
        x.grad = None
        with TensorBytesCounter() as counter:
            out = norm(x)
            out.sum().backward()
        return out.detach(), x.grad.clone(), counter.peak_bytes

    ref_out, ref_grad, whole = run()
    handle = apply_tiled_mlp(model, tile_tokens=8)
    out, grad, tiled = run()
    torch.testing.assert_close(out, ref_out, atol=0, rtol=0)
    torch.testing.assert_close(grad, ref_grad, atol=0, rtol=0)  # token-wise: bit for bit
    hidden_fp32 = 2 * 64 * 32 * 4  # one fp32 copy of the whole input
    assert whole >= 4 * hidden_fp32 and tiled <= whole / 3, (whole, tiled)
    handle.remove()
    assert "forward" not in norm.__dict__ and "forward" not in model.model.norm.__dict__


def test_gpt2_batch_of_two_and_a_bare_decoder():
    """Tiles of a batch of several sequences are strided views: GPT-2's Conv1D (which
    views its input) runs on them. A bare decoder (blocks at the top, ``layers.N``) has its
    final norm tiled too."""
    from engine.models import batches as kind_batches
    from engine.models import build as build_kind

    base = build_kind("gpt2")
    data = kind_batches("gpt2", 1, batch=2, seq=SEQ)[0]
    ref_loss, ref_grads = _grads(copy.deepcopy(base), data)
    model = copy.deepcopy(base)
    handle = apply_tiled_mlp(model, tile_tokens=TILE)
    assert "transformer.ln_f" in handle.norm_names
    loss, grads = _grads(model, data)
    assert loss == pytest.approx(ref_loss, abs=1e-6)
    for name, g in ref_grads.items():
        torch.testing.assert_close(grads[name], g, atol=1e-6, rtol=1e-6, msg=name)
    bare = build("llama").model  # LlamaModel: blocks named layers.N
    assert apply_tiled_mlp(bare, tile_tokens=TILE).norm_names[-1] == "norm"
