"""ProTrain: memory-aware fine-tuning.

The engine API (``wrap``, ``close``, ``state_dict``, ``load_state_dict``, ``plan_of``) is imported on
first use, so that ``import protrain`` stays light (no torch import) for the CLI.
"""

__version__ = "0.1.0"

_ENGINE_API = (
    "wrap",
    "close",
    "state_dict",
    "load_state_dict",
    "full_tensor",
    "own_values",
    "plan_of",
)
__all__ = ["__version__", *_ENGINE_API]


def __getattr__(name: str):
    if name in _ENGINE_API:
        import importlib

        value = getattr(importlib.import_module("protrain.engine"), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'protrain' has no attribute {name!r}")
