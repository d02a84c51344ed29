"""Fault-tolerant averaging: Moshpit matchmaking, butterfly all-reduce, load balancing,
gossip, and state download for joining peers."""

from swarmgrad.averaging.gossip import AsyncGossipAverager, GossipAverager, GossipResult
from swarmgrad.averaging.group_info import GroupInfo
from swarmgrad.averaging.key_manager import Declaration, GroupKeyManager
from swarmgrad.averaging.matchmaking import Matchmaking
from swarmgrad.averaging.state_transfer import StateDownloader, StateSharing, load_state_from_peers

__all__ = [
    "AsyncGossipAverager",
    "Declaration",
    "GossipAverager",
    "GossipResult",
    "GroupInfo",
    "GroupKeyManager",
    "Matchmaking",
    "StateDownloader",
    "StateSharing",
    "load_state_from_peers",
]
