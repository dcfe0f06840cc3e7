"""ProTrain: memory-aware fine-tuning.

The API (``wrap``, ``close``, ``state_dict``, ``load_state_dict``, ``plan_of``) is imported on
first use, so that ``import protrain`` stays light (no torch import) for the CLI. ``wrap``
plans, then wraps (``protrain/planned_wrap.py``); the rest is the engine's
(``protrain/engine.py``).
"""

import importlib

__version__ = "0.1.0"

# public name -> the module that defines it
_API = {
    "wrap": "protrain.planned_wrap",
    "close": "protrain.engine",
    "state_dict": "protrain.engine",
    "load_state_dict": "protrain.engine",
    "full_tensor": "protrain.engine",
    "own_values": "protrain.engine",
    "plan_of": "protrain.engine",
}
__all__ = ["__version__", *_API]


def __getattr__(name: str):
    if name in _API:
        value = getattr(importlib.import_module(_API[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'protrain' has no attribute {name!r}")
