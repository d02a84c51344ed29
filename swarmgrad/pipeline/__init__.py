"""SWARM pipeline parallelism: a model larger than any one peer, split into stages, each
stage served by a swarm of peers, micro-batches routed through one server per stage by
measured throughput and around failures, peers rebalanced towards the bottleneck stage.

- :mod:`.protocol`: RPC names, messages, the DHT record;
- :mod:`.routing`: choosing a server per hop, bans, hop deadlines (pure);
- :mod:`.rebalance`: which peer moves to the bottleneck stage (pure);
- :mod:`.server`: ``StageServer``, one stage on one peer;
- :mod:`.training`: ``StageAverager``, a stage's peers averaging and sharing state;
- :mod:`.peer`: ``StagePeer``, server + averaging + rebalancing, what a peer runs;
- :mod:`.client`: ``RemotePipeline``, the trainer's module;
- :mod:`.stages`: the stage-module convention and the chain check.
"""

from swarmgrad.pipeline.client import PipelineCaller, PipelineOptions, RemotePipeline
from swarmgrad.pipeline.peer import StagePeer, StagePeerOptions, read_stage_loads
from swarmgrad.pipeline.protocol import StageInfo, StageRecord, stage_key
from swarmgrad.pipeline.rebalance import (
    Move,
    RebalanceOptions,
    Rebalancer,
    pipeline_throughput,
    plan_move,
)
from swarmgrad.pipeline.routing import RoutingOptions, ServerLoad, StageRouter
from swarmgrad.pipeline.server import StageServer, StageServerOptions, StageServicer
from swarmgrad.pipeline.stages import (
    StageModule,
    StageModuleError,
    StageSpec,
    load_stage_module,
    make_stage_backend,
    split_stages,
)
from swarmgrad.pipeline.training import StageAverager, StageTrainingOptions

__all__ = [
    "Move",
    "PipelineCaller",
    "PipelineOptions",
    "RebalanceOptions",
    "Rebalancer",
    "RemotePipeline",
    "RoutingOptions",
    "ServerLoad",
    "StageAverager",
    "StageInfo",
    "StageModule",
    "StageModuleError",
    "StagePeer",
    "StagePeerOptions",
    "StageRecord",
    "StageRouter",
    "StageServer",
    "StageServerOptions",
    "StageServicer",
    "StageSpec",
    "StageTrainingOptions",
    "load_stage_module",
    "make_stage_backend",
    "pipeline_throughput",
    "plan_move",
    "read_stage_loads",
    "split_stages",
    "stage_key",
]
