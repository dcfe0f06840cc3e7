"""Model structure: the repeated layers (blocks) and the parameters outside them."""

from protrain.model.blocks import BlockDiscoveryError, discover_blocks
from protrain.model.layout import Block, BlockLayout

__all__ = ["Block", "BlockDiscoveryError", "BlockLayout", "discover_blocks"]
