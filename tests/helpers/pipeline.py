"""In-process pipeline swarms for the pipeline tests: a root DHT, stage servers on their
own DHT peers, and trainers' RemotePipelines."""

from __future__ import annotations

import itertools

import torch
from torch import nn

from swarmgrad.dht import DHT
from swarmgrad.moe.protocol import BatchTensorDescriptor
from swarmgrad.moe.server import ModuleBackend
from swarmgrad.pipeline import (
    PipelineOptions,
    RemotePipeline,
    RoutingOptions,
    StageServer,
    StageServerOptions,
)

_names = itertools.count()


def make_backend(name: str, module: nn.Module, width: int, lr: float = 0.0, **kwargs):
    optimizer = torch.optim.SGD(module.parameters(), lr=lr) if lr else None
    return ModuleBackend(
        name,
        module,
        optimizer=optimizer,
        args_schema=(BatchTensorDescriptor(width),),
        timeout=0.001,
        **kwargs,
    )


class PipelineSwarm:
    """A root DHT and whatever stage servers and trainers a test adds; all stop on exit."""

    def __init__(self):
        self.root = DHT(start=True)
        self.addrs = self.root.get_visible_maddrs()
        self.dhts: list[DHT] = [self.root]
        self.servers: list[StageServer] = []

    @staticmethod
    def new_name() -> str:
        return f"pipe{next(_names)}"

    def serve(self, pipeline, stage, num_stages, module, width, *, lr=0.0, servicer=None,
              update_period=2.0, cache_bytes=1 << 26, backend=None,
              **backend_kwargs) -> StageServer:  # fmt: skip
        dht = DHT(start=True, initial_peers=self.addrs)
        self.dhts.append(dht)
        if backend is None:
            backend = make_backend(f"{pipeline}.{stage}", module, width, lr, **backend_kwargs)
        server = StageServer(
            dht,
            pipeline,
            stage,
            num_stages,
            backend,
            StageServerOptions(update_period=update_period, activation_cache_bytes=cache_bytes),
        )
        if servicer is not None:
            server.servicer = servicer(server)
        server.start()
        self.servers.append(server)
        return server

    def pipeline(self, pipeline, num_stages, seed=0, **options) -> RemotePipeline:
        import random

        routing = options.pop("routing", {})
        dht = DHT(start=True, initial_peers=self.addrs, client_mode=True)
        self.dhts.append(dht)
        opts = PipelineOptions(routing=RoutingOptions(**routing), **options)
        return RemotePipeline(dht, pipeline, num_stages, opts, rng=random.Random(seed))

    def close(self):
        for server in self.servers:
            try:
                server.shutdown()
            except Exception:
                pass
        for dht in reversed(self.dhts):
            dht.shutdown()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
