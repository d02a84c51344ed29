"""Optional adapters between swarmgrad and the training frameworks people already use.

Each adapter is a module imported on its own, only when it is used, so that
``import swarmgrad`` never pulls in a framework:

* ``swarmgrad.integrations.lightning``: :class:`SwarmgradStrategy`, a PyTorch Lightning
  strategy (``pip install swarmgrad[lightning]``);
* ``swarmgrad.integrations.transformers``: a ``transformers.Trainer`` callback and the
  pieces to hand it a collaborative optimizer (``pip install swarmgrad[transformers]``).

Without its extra, importing an adapter raises :class:`MissingExtraError`, which names
the extra to install.
"""

from swarmgrad.integrations._extras import MissingExtraError
from swarmgrad.integrations.epoch_scheduler import EpochScheduler

__all__ = ["EpochScheduler", "MissingExtraError"]
