"""The placement rule: swapped blocks first, checkpointed interleaved, kept last."""

from __future__ import annotations

import pytest

from protrain.activations import ActivationPolicy, place_policies

K, C, S, OC = (
    ActivationPolicy.KEEP,
    ActivationPolicy.CHECKPOINT,
    ActivationPolicy.SWAP,
    ActivationPolicy.OFFLOAD_CHECKPOINT,
)


@pytest.mark.parametrize(
    "n, n_swap, n_ckpt, want",
    [
        (4, 0, 0, [K, K, K, K]),
        (4, 0, 2, [C, C, K, K]),
        (4, 2, 0, [S, S, K, K]),
        (6, 2, 2, [S, C, S, C, K, K]),
        (8, 2, 4, [S, C, C, S, C, C, K, K]),
        (5, 1, 3, [S, C, C, C, K]),
        (5, 3, 1, [S, S, C, S, K]),
        (3, 3, 0, [S, S, S]),
    ],
)
def test_rule(n, n_swap, n_ckpt, want):
    assert place_policies(n, n_swap, n_ckpt) == want


def test_counts_hold_for_every_split():
    for n in range(1, 12):
        for n_swap in range(n + 1):
            for n_ckpt in range(n + 1 - n_swap):
                p = place_policies(n, n_swap, n_ckpt)
                assert (p.count(S), p.count(C), p.count(K)) == (n_swap, n_ckpt, n - n_swap - n_ckpt)
                assert p[n_swap + n_ckpt :] == [K] * (n - n_swap - n_ckpt)  # kept blocks last
                if n_swap:
                    assert p[0] is S  # swapped blocks first


def test_offload_checkpoint_inputs():
    assert place_policies(4, 1, 2, offload_checkpoint_inputs=True) == [S, OC, OC, K]


@pytest.mark.parametrize("args", [(4, 3, 2), (4, -1, 0), (2, 0, 1.5)])
def test_bad_knobs(args):
    with pytest.raises(ValueError):
        place_policies(*args)


def test_string_values():
    assert ActivationPolicy("offload_checkpoint") is OC and S.value == "swap"
