"""The CUDA caching allocator's settings that the engine's memory plans assume.

The engine frees and re-allocates blocks of many sizes every step (buffer pool pieces,
activations of varying policies, fp32 gradient accumulators made in backward and freed at
``zero_grad``). With the allocator's default fixed-size segments, the holes this leaves
cost 5-15% of the peak on the models we measured (reserved minus allocated at the peak),
and the amount depends on allocation order, which no plan can predict. Expandable segments
grow one mapping per stream instead, which keeps reserved memory close to allocated, so
the planner's allocator term stays small and predictable.

The setting must be in the environment before CUDA makes its first allocation, so the
application and the benchmark scripts call :func:`prefer_expandable_segments` at start; a
library user sets ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`` themselves. A value
the user already set is never changed.
"""

from __future__ import annotations

import os

_VARS = ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")
SETTING = "expandable_segments:True"


def prefer_expandable_segments() -> bool:
    """Ask for expandable segments unless the user configured the allocator; True if set."""
    if any(os.environ.get(v) for v in _VARS):
        return False
    os.environ["PYTORCH_CUDA_ALLOC_CONF"] = SETTING
    return True
