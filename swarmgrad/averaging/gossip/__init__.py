"""Pair-wise gossip averaging with dpwa's mixing rules (:mod:`.rules`, no I/O) and its
averager (:mod:`.averager`)."""

from swarmgrad.averaging.gossip.averager import AsyncGossipAverager, GossipAverager, GossipResult

__all__ = ["AsyncGossipAverager", "GossipAverager", "GossipResult"]
