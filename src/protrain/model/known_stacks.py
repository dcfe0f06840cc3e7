"""Stacks named by hand, for modules that the generic rule in `blocks.py` misreads.

Keyed by the class name of a module; each value lists stack paths relative to that module.
Where the walk of `discover_blocks` meets such a module, it takes these stacks for the
module's subtree and reads the rest of the model by the generic rule. Entries are data: add
a model here, never a branch in the discovery code, and only with a test that shows the
rule failing for it.
"""

KNOWN_STACKS: dict[str, tuple[str, ...]] = {
    # Beside `blocks`, `deepstack_merger_list` holds mergers applied to the outputs of a few
    # vision blocks: a side branch, not a stack run in sequence. The mergers are non-block.
    "Qwen3VLVisionModel": ("blocks",),
    "Qwen3VLMoeVisionModel": ("blocks",),
}
