"""Moshpit matchmaking: peers meet in the DHT under group keys and a leader forms a group.

* :mod:`.group_bits`, :mod:`.key_manager` — group keys and declarations in the DHT
* :mod:`.driver` — :class:`Matchmaking`, the I/O that finds a group
"""

from swarmgrad.averaging.matchmaking.driver import Matchmaking

__all__ = ["Matchmaking"]
