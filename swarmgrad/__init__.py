"""swarmgrad: train large neural networks on computers lent over the internet."""

from swarmgrad.utils.errors import SwarmgradError

__version__ = "0.1.0"
__all__ = ["SwarmgradError", "__version__"]
