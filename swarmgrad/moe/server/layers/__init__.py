"""Expert classes servers host by name, and the registry that maps names to classes."""

from swarmgrad.moe.server.layers import common
from swarmgrad.moe.server.layers.common import (
    DeterministicDropout,
    FeedforwardBlock,
    NopExpert,
    TransformerEncoderBlock,
)
from swarmgrad.moe.server.layers.registry import (
    load_custom_module,
    name_to_block,
    name_to_input,
    register_expert_class,
)

del common

__all__ = [
    "DeterministicDropout",
    "FeedforwardBlock",
    "NopExpert",
    "TransformerEncoderBlock",
    "load_custom_module",
    "name_to_block",
    "name_to_input",
    "register_expert_class",
]
