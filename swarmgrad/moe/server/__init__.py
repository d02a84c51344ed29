"""The expert server: hosts experts, batches their requests on one device thread,
declares them in the DHT and checkpoints them.

- :mod:`.layers`: built-in expert classes and ``register_expert_class``;
- :mod:`.module_backend`: one expert (module, optimizer, schemas, pools);
- :mod:`.task_pool` / :mod:`.runtime`: batching and the device thread;
- :mod:`.connection_handler`: the ``moe.*`` RPC handlers;
- :mod:`.dht_handler`: declarations in the DHT; :mod:`.expert_pattern`: uid patterns;
- :mod:`.checkpoints`: checkpoints on disk; :mod:`.server`: ``Server`` ties them together.
"""

from swarmgrad.moe.dht_records import declare_experts
from swarmgrad.moe.server.checkpoints import CheckpointSaver, load_experts, store_experts
from swarmgrad.moe.server.connection_handler import ConnectionHandler
from swarmgrad.moe.server.dht_handler import ExpertDeclarer, generate_free_uids
from swarmgrad.moe.server.expert_pattern import (
    ExpertPattern,
    generate_uids_from_pattern,
    parse_expert_pattern,
)
from swarmgrad.moe.server.layers import name_to_block, name_to_input, register_expert_class
from swarmgrad.moe.server.module_backend import ModuleBackend
from swarmgrad.moe.server.runtime import Runtime
from swarmgrad.moe.server.schedulers import get_linear_schedule_with_warmup
from swarmgrad.moe.server.server import PeerInfo, Server, background_server
from swarmgrad.moe.server.task_pool import ExpertFailure, TaskPool

__all__ = [
    "CheckpointSaver",
    "ConnectionHandler",
    "ExpertDeclarer",
    "ExpertFailure",
    "ExpertPattern",
    "ModuleBackend",
    "PeerInfo",
    "Runtime",
    "Server",
    "TaskPool",
    "background_server",
    "declare_experts",
    "get_experts",
    "generate_free_uids",
    "generate_uids_from_pattern",
    "get_linear_schedule_with_warmup",
    "load_experts",
    "name_to_block",
    "name_to_input",
    "parse_expert_pattern",
    "register_expert_class",
    "store_experts",
]


def __getattr__(name: str):
    # hivemind.moe.server.get_experts: the client's lookup, imported on first use (the
    # client package imports the server's schemas, not the other way round)
    if name == "get_experts":
        from swarmgrad.moe.client.expert import get_experts

        return get_experts
    raise AttributeError(f"module 'swarmgrad.moe.server' has no attribute {name!r}")
