"""SWARM pipeline parallelism: a model larger than any one peer, split into stages, each
stage served by a swarm of peers, micro-batches routed through one server per stage by
measured throughput and around failures, peers rebalanced towards the bottleneck stage.

- :mod:`.protocol`: RPC names, messages, the DHT record;
- :mod:`.routing`: choosing a server per hop, bans, hop deadlines (pure);
- :mod:`.server`: ``StageServer``, one stage on one peer;
- :mod:`.client`: ``RemotePipeline``, the trainer's module.
"""

from swarmgrad.pipeline.client import PipelineCaller, PipelineOptions, RemotePipeline
from swarmgrad.pipeline.protocol import StageInfo, StageRecord, stage_key
from swarmgrad.pipeline.routing import RoutingOptions, ServerLoad, StageRouter
from swarmgrad.pipeline.server import StageServer, StageServerOptions, StageServicer

__all__ = [
    "PipelineCaller",
    "PipelineOptions",
    "RemotePipeline",
    "RoutingOptions",
    "ServerLoad",
    "StageInfo",
    "StageRecord",
    "StageRouter",
    "StageServer",
    "StageServerOptions",
    "StageServicer",
    "stage_key",
]
