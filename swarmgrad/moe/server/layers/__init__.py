"""Expert classes servers host by name, and the registry that maps names to classes."""

from swarmgrad.moe.server.layers.common import (  # importing it registers the classes
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
