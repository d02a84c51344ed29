"""The simulated network: the asyncio transport interface in memory, on a virtual clock.

Protocol code written for real asyncio transports runs unmodified on
:class:`SimNetwork`; :class:`VirtualClockEventLoop` makes time virtual so that large
swarms run fast and the same seed gives the same run. See :mod:`.clock` and
:mod:`.network` for the rules and the link model.
"""

from swarmgrad.net.sim.clock import (
    SimulationStalled,
    VirtualClockEventLoop,
    run_simulation,
    virtual_loop,
)
from swarmgrad.net.sim.network import LinkSettings, SimListener, SimNetwork, SimTransport

__all__ = [
    "LinkSettings",
    "SimListener",
    "SimNetwork",
    "SimTransport",
    "SimulationStalled",
    "VirtualClockEventLoop",
    "run_simulation",
    "virtual_loop",
]
