"""A backward that raises on every rank leaves nothing behind in the gradient reducer: the
next forward starts the reductions afresh (``GradReducer.abandon_backward``), so the step
after ``zero_grad()`` equals the same step in a run where nothing raised, bit for bit.

Before, the reducer's end-of-backward callback (which resets its per-backward state) never
ran after a raise: with the raise after the last bucket was reduced, the next backward
reduced nothing and delivered no gradient, and ``step()`` changed no weight, silently; a
raise mid-way made the next backward fail with a false "second gradient" error."""

from __future__ import annotations

import torch
from tests.engine.models import batches, build

import protrain

from .ranks import run_ranks

LR = 1e-2


def _run(rank: int, world: int, mode: str, where: str, raise_first: bool) -> dict:
    model, opt, _ = protrain.wrap(
        build("llama"), device="cpu", n_persist=1, lr=LR, chunk_size_bytes=16384,
        distributed_mode=mode, grad_reduce="sum",
    )  # fmt: skip
    data = batches("llama", 2 * world)
    armed = {"on": raise_first}

    def boom(*_):
        if armed["on"]:
            raise RuntimeError("boom")

    if where == "last-gradient":  # after the last bucket is reduced: the embedding's grad
        model.model.embed_tokens.weight.register_post_accumulate_grad_hook(boom)
    else:  # mid-way: the gradient flowing into the first block's output

        def mark(module, args, out):
            h = out[0] if isinstance(out, tuple) else out
            h.register_hook(boom)

        model.model.layers[0].register_forward_hook(mark)
    if raise_first:
        try:
            (model(**data[rank]).loss / world).backward()
        except RuntimeError as exc:
            assert "boom" in str(exc)
        else:
            raise AssertionError("the backward did not raise")
        armed["on"] = False
        opt.zero_grad()
    (model(**data[world + rank]).loss / world).backward()
    opt.step()
    out = {k: v.clone() for k, v in protrain.state_dict(model).items()}
    protrain.close(model)
    return out


def _ranks(rank: int, world: int) -> None:
    modes = ("sharded", "replicated") if world == 2 else ("sharded",)
    for mode in modes:
        want = _run(rank, world, mode, "last-gradient", raise_first=False)
        for where in ("last-gradient", "mid-way"):
            got = _run(rank, world, mode, where, raise_first=True)
            for name, w in want.items():
                assert torch.equal(got[name], w), (rank, world, mode, where, name)


def test_a_backward_that_raised_on_every_rank_leaves_no_state():
    run_ranks(2, _ranks)
    run_ranks(3, _ranks)
