"""Decentralized mixture-of-experts: expert uids, DHT records, servers and clients."""

from swarmgrad.moe.dht_records import declare_experts, get_experts_info
from swarmgrad.moe.expert_uid import (
    UID_DELIMITER,
    ExpertInfo,
    ServerInfo,
    is_valid_prefix,
    is_valid_uid,
    split_uid,
)

__all__ = [
    "UID_DELIMITER",
    "ExpertInfo",
    "ServerInfo",
    "declare_experts",
    "get_experts_info",
    "is_valid_prefix",
    "is_valid_uid",
    "split_uid",
]
