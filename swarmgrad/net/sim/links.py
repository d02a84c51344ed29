"""The link model of the simulated network: per-link settings, their checks, the hosts
and the transmit queue of each directed link.

Split from :mod:`swarmgrad.net.sim.network` (which documents the model as a whole) so
that the rules of a link (how its settings combine, how chunks share its bandwidth) read
apart from the transports that use them and the faults that cut them.
"""

from __future__ import annotations

import enum
import math
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from swarmgrad.utils.errors import ValidationError

if TYPE_CHECKING:
    from swarmgrad.net.sim.network import SimNetwork
    from swarmgrad.net.sim.transport import SimListener, SimTransport

DEFAULT_HIGH_WATER = 64 * 1024


class Unset(enum.Enum):
    """A per-host setting not given (``None`` is a value there: unlimited bandwidth)."""

    UNSET = enum.auto()


UNSET = Unset.UNSET


class Signal(enum.Enum):
    """Non-data items travelling on a connection, in order with its data."""

    SYN_ACK = "syn-ack"  # the server accepted: the client side is established on arrival
    EOF = "eof"  # the sender closed gracefully
    RST = "rst"  # the sender reset the connection
    LOSS = "loss"  # a chunk was lost in transit: the connection resets on both sides


@dataclass(frozen=True)
class LinkSettings:
    """The effective settings of one directed link."""

    latency: float
    bandwidth: float | None
    drop_probability: float


def check_latency(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValidationError(f"latency must be a number of seconds, got {value!r}")
    if not (0 <= value < math.inf):
        raise ValidationError(f"latency must be finite and >= 0 seconds, got {value!r}")
    return float(value)


def check_bandwidth(value: Any) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
        raise ValidationError(f"bandwidth must be None or bytes per second > 0, got {value!r}")
    return None if value == math.inf else float(value)


def check_drop_probability(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value <= 1:
        raise ValidationError(f"drop_probability must be within [0, 1], got {value!r}")
    return float(value)


def check_address(address: Any) -> str:
    if not isinstance(address, str) or not address:
        raise ValidationError(f"a simulated host address must be a non-empty str, got {address!r}")
    return address


class Host:
    __slots__ = (
        "address",
        "bandwidth",
        "drop_probability",
        "latency",
        "listener",
        "transports",
        "up",
    )

    def __init__(self, address: str) -> None:
        self.address = address
        self.listener: SimListener | None = None
        self.up = True
        # an ordered set: iteration order must not depend on object addresses
        self.transports: dict[SimTransport, None] = {}
        self.latency: float | Unset = UNSET
        self.bandwidth: float | Unset | None = UNSET
        self.drop_probability: float | Unset = UNSET


class Link:
    """One directed link: its current settings and its transmit queue."""

    __slots__ = (
        "bandwidth",
        "busy",
        "drop_probability",
        "dst",
        "latency",
        "network",
        "queue",
        "src",
        "version",
    )

    def __init__(self, network: SimNetwork, src: str, dst: str) -> None:
        self.network = network
        self.src = src
        self.dst = dst
        self.version = -1
        self.latency = 0.0
        self.bandwidth: float | None = None
        self.drop_probability = 0.0
        self.queue: deque[SimTransport] = deque()  # connections waiting to send a chunk
        self.busy = False  # a chunk is being serialized, or a transmit step is scheduled
        self.refresh()

    def refresh(self) -> None:
        if self.version != self.network._settings_version:
            settings = self.network.link_settings(self.src, self.dst)
            self.latency = settings.latency
            self.bandwidth = settings.bandwidth
            self.drop_probability = settings.drop_probability
            self.version = self.network._settings_version

    def enqueue(self, transport: SimTransport) -> None:
        transport._queued = True
        self.queue.append(transport)
        if not self.busy:
            self.busy = True
            # start on the next loop step, so writes made together travel together and
            # no protocol callback runs inside write()
            transport._loop.call_soon(self._transmit_next)

    def _transmit_next(self) -> None:
        self.busy = False
        self.refresh()
        queue = self.queue
        while queue:
            transport = queue.popleft()
            transport._queued = False
            bandwidth = self.bandwidth
            if bandwidth is None:  # the link was made unlimited while this one waited
                transport._pump()
                continue
            chunk = transport._take_chunk()
            if chunk is None:
                continue
            loop = transport._loop
            done = loop.time() + len(chunk) / bandwidth
            transport._transmit(chunk, done + self.latency)
            if transport._send_buf:
                transport._queued = True
                queue.append(transport)
            self.busy = True
            loop.call_at(done, self._transmit_next)
            transport._after_send()
            return


__all__ = [
    "DEFAULT_HIGH_WATER",
    "UNSET",
    "Host",
    "Link",
    "LinkSettings",
    "Signal",
    "Unset",
    "check_address",
    "check_bandwidth",
    "check_drop_probability",
    "check_latency",
]
