"""``import swarmgrad.hivemind_alias``: from here on, ``import hivemind`` (and any
``hivemind.X``) gives swarmgrad. The same as ``swarmgrad.install_hivemind_alias()``;
see :mod:`swarmgrad.utils.module_alias`."""

from swarmgrad.utils.module_alias import install_hivemind_alias

install_hivemind_alias()
