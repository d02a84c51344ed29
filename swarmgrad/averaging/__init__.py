"""Fault-tolerant averaging: Moshpit matchmaking, butterfly all-reduce, load balancing,
gossip, and state download for joining peers."""

from swarmgrad.averaging.group_info import GroupInfo

__all__ = ["GroupInfo"]
