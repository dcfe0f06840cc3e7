"""Replace a module's ``forward`` on that instance only, with an undo.

Every activation technique (checkpoint, swap, tiled MLP, the saved-bytes probe) wraps a
module this way: ``nn.Module.__call__`` still runs the module's hooks around the wrapper (the
chunk runtime's included), parameter names and the module tree do not change, and the undo
restores whatever attribute was there before.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

_MISSING = object()


def wrap_forward(module: nn.Module, make: Callable[[Callable], Callable]) -> Callable[[], None]:
    """Set ``module.forward`` to ``make(original forward)``; return the undo."""
    previous = module.__dict__.get("forward", _MISSING)
    module.forward = make(module.forward)

    def undo() -> None:
        if previous is _MISSING:
            del module.forward
        else:
            module.forward = previous

    return undo
