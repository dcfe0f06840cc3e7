"""Stacks named by hand, for architectures that the generic rule in `blocks.py` misreads.

Keyed by `config.model_type`; each value lists stack paths relative to the module that
carries that config (the `PreTrainedModel`, under any PEFT wrapper). Entries are data: add a
model here, never a branch in the discovery code. Keep this table empty unless a test shows
the generic rule failing for the model.
"""

KNOWN_STACKS: dict[str, tuple[str, ...]] = {}
