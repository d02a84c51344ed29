"""Decentralized mixture-of-experts: expert uids, DHT records, servers and clients."""

from swarmgrad.moe.client import (
    MoEBeamSearcher,
    RemoteExpert,
    RemoteMixtureOfExperts,
    RemoteSwitchMixtureOfExperts,
    create_remote_experts,
    get_experts,
)
from swarmgrad.moe.dht_records import declare_experts, get_experts_info
from swarmgrad.moe.expert_uid import (
    UID_DELIMITER,
    ExpertInfo,
    ServerInfo,
    is_valid_prefix,
    is_valid_uid,
    split_uid,
)
from swarmgrad.moe.server import ModuleBackend, Server, background_server, register_expert_class

__all__ = [
    "UID_DELIMITER",
    "ExpertInfo",
    "ModuleBackend",
    "MoEBeamSearcher",
    "RemoteExpert",
    "RemoteMixtureOfExperts",
    "RemoteSwitchMixtureOfExperts",
    "Server",
    "ServerInfo",
    "background_server",
    "create_remote_experts",
    "declare_experts",
    "get_experts",
    "get_experts_info",
    "is_valid_prefix",
    "is_valid_uid",
    "register_expert_class",
    "split_uid",
]
