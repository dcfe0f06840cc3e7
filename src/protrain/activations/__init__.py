"""Activation memory: a policy per block (keep, checkpoint, swap, offload-checkpoint), tiled
MLP and chunked loss for long sequences, and the saved-bytes formula the plan uses.

One concept per file: ``policy`` (the policies and the placement rule), ``checkpoint``,
``swap`` (with ``transfer``, the host copies on copy streams), ``offload_checkpoint``,
``apply`` (putting policies on a model), ``tiled_mlp``, ``chunked_loss``, ``estimate``.
"""

from protrain.activations.apply import (
    ActivationHandle,
    apply_activation_knobs,
    apply_activation_policies,
)
from protrain.activations.chunked_loss import (
    LogitTransform,
    UnsupportedHead,
    causal_lm_head,
    chunked_causal_lm_loss_sum,
)
from protrain.activations.policy import ActivationPolicy, as_policies, place_policies
from protrain.activations.swap import ActivationSwapper
from protrain.activations.tiled_mlp import apply_tiled_mlp

__all__ = [
    "ActivationHandle",
    "ActivationPolicy",
    "ActivationSwapper",
    "LogitTransform",
    "UnsupportedHead",
    "apply_activation_knobs",
    "apply_activation_policies",
    "apply_tiled_mlp",
    "as_policies",
    "causal_lm_head",
    "chunked_causal_lm_loss_sum",
    "place_policies",
]
