"""The client side of decentralized mixture-of-experts: remote experts as modules, beam
search over the DHT, and the mixture-of-experts layers."""

from swarmgrad.moe.client.beam_search import MoEBeamSearcher
from swarmgrad.moe.client.caller import ExpertCaller, ExpertSchema
from swarmgrad.moe.client.dispatch import NoExpertsAnswered
from swarmgrad.moe.client.expert import RemoteExpert, create_remote_experts, get_experts
from swarmgrad.moe.client.moe import RemoteMixtureOfExperts
from swarmgrad.moe.client.switch_moe import RemoteSwitchMixtureOfExperts

__all__ = [
    "ExpertCaller",
    "ExpertSchema",
    "MoEBeamSearcher",
    "NoExpertsAnswered",
    "RemoteExpert",
    "RemoteMixtureOfExperts",
    "RemoteSwitchMixtureOfExperts",
    "create_remote_experts",
    "get_experts",
]
