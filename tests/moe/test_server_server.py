"""Server: creation from options, DHT declaration and withdrawal, uid choice, the
context managers, and checkpoints across restarts."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import pytest
import torch

from swarmgrad.compression.wire import tensors_from_message, tensors_to_message
from swarmgrad.dht import DHT
from swarmgrad.dht.node import DHTNode
from swarmgrad.moe import protocol
from swarmgrad.moe.dht_records import get_experts_info_on_node
from swarmgrad.moe.protocol import BatchTensorDescriptor
from swarmgrad.moe.server import ModuleBackend, Server, background_server
from swarmgrad.net.peer import Peer
from swarmgrad.utils.errors import ValidationError
from swarmgrad.utils.loop_thread import run_coroutine

LOOPBACK = ["/ip4/127.0.0.1/tcp/0"]
TIMEOUT = 30.0


def lookup(dht: DHT, uids: list[str]):
    return dht.run_coroutine(lambda _dht, node: get_experts_info_on_node(node, uids, latest=True))


def call(addr, name: str, request: dict) -> dict:
    async def go():
        client = await Peer.create()
        try:
            return await client.call(addr, name, request, timeout=TIMEOUT)
        finally:
            await client.shutdown()

    return run_coroutine(go(), timeout=TIMEOUT + 10)


def wait_for(predicate, what: str) -> None:
    deadline = time.monotonic() + TIMEOUT
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def test_experts_are_declared_refreshed_and_withdrawn_in_the_dht():
    with (
        DHT(start=True) as root,
        DHT(
            initial_peers=[str(root.get_visible_maddrs()[0])], start=True, client_mode=True
        ) as client,
    ):
        server = Server.create(
            num_experts=3,
            expert_pattern="ffn.[0:4].[0:4]",
            hidden_dim=8,
            update_period=0.2,
            initial_peers=[str(root.get_visible_maddrs()[0])],
            host_maddrs=LOOPBACK,
            start=True,
        )
        try:
            uids = sorted(server.module_backends)
            assert len(uids) == 3 and server.ready.is_set()
            assert server.expiration == 60.0  # max(2 * update_period, 60)
            infos = lookup(client, uids)
            assert all(i is not None and i.peer_id == server.dht.peer_id for i in infos)
            wait_for(lambda: server.declarer.declarations >= 3, "three declaration rounds")
        finally:
            server.shutdown()
        assert lookup(client, uids) == [None, None, None]
        assert server.dht.node is None  # the server stopped the DHT it started


def test_a_second_server_on_the_same_grid_picks_the_free_uids():
    with DHT(start=True) as root:
        peers = [str(root.get_visible_maddrs()[0])]
        common = dict(expert_cls="nop", hidden_dim=4, initial_peers=peers, host_maddrs=LOOPBACK)
        first = Server.create(num_experts=2, expert_pattern="n.[0:4]", start=True, **common)
        try:
            second = Server.create(num_experts=2, expert_pattern="n.[0:4]", start=True, **common)
            try:
                assert set(first.module_backends) | set(second.module_backends) == {
                    "n.0",
                    "n.1",
                    "n.2",
                    "n.3",
                }
            finally:
                second.shutdown()
        finally:
            first.shutdown()


def test_background_server_serves_raw_protocol_calls():
    with background_server(
        expert_uids=["nop.0", "nop.1"], expert_cls="nop", hidden_dim=8, host_maddrs=LOOPBACK
    ) as info:
        assert info.addrs and str(info.addrs[0]).endswith(f"/p2p/{info.peer_id}")
        x = torch.randn(1, 8)
        reply = call(
            info.addrs[0], protocol.FORWARD, {"uid": "nop.1", "inputs": tensors_to_message([x])}
        )
        (out,) = tensors_from_message(reply["outputs"])
        assert torch.equal(out, x)


def test_checkpoints_survive_a_restart(tmp_path):
    options = dict(
        expert_uids=["ffn.0"],
        hidden_dim=8,
        host_maddrs=LOOPBACK,
        checkpoint_dir=tmp_path,
        checkpoint_interval=3600,
        scheduler="linear",
        num_warmup_steps=1,
        num_training_steps=10,
    )
    with Server.create(**options) as server:
        addr = server.dht.get_visible_maddrs()[0]
        x, g = torch.randn(4, 8), torch.randn(4, 8)
        request = {
            "uid": "ffn.0",
            "inputs": tensors_to_message([x]),
            "grad_outputs": tensors_to_message([g]),
        }
        for _ in range(2):
            call(addr, protocol.BACKWARD, request)
        backend = server.module_backends["ffn.0"]
        assert backend.update_count == 2
    trained = {k: v.clone() for k, v in backend.module.state_dict().items()}
    assert (tmp_path / "ffn.0").is_dir()

    restarted = Server.create(**options)  # restores at construction, before serving
    try:
        restored = restarted.module_backends["ffn.0"]
        assert restored.update_count == 2 and restored.scheduler.last_epoch == 2
        for key, value in restored.module.state_dict().items():
            assert torch.equal(value, trained[key])
    finally:
        restarted.shutdown()


@pytest.mark.parametrize(
    ("options", "complaint"),
    [
        (dict(num_experts=2, expert_pattern="ffn.[0:4"), r"dimension 0 is '\[0:4'"),
        (dict(num_experts=5, expert_pattern="ffn.[0:4]"), "only 4 uids, fewer than num_experts=5"),
        # num_experts alone is valid, as in hivemind (expert.0, expert.1, ...): nothing is not
        (dict(), "give expert_uids, or num_experts"),
        (dict(expert_uids=["ffn.0"], expert_pattern="ffn.[0:4]"), "not both"),
        (dict(expert_uids=["ffn.0", "ffn.0"]), "duplicates"),
        (dict(expert_uids=["ffn"]), "not an expert uid"),
        (dict(expert_uids=["x.0"], expert_cls="mlp"), "unknown expert class 'mlp'; known: "),
        (dict(expert_uids=["x.0"], scheduler="linear"), "needs num_training_steps"),
        (dict(expert_uids=["x.0"], scheduler="cosine"), "unknown scheduler 'cosine'"),
        (dict(expert_uids=["x.0"], hidden_dim=0), "hidden_dim must be a positive int"),
    ],
)
def test_bad_server_options_are_refused_before_anything_starts(options, complaint):
    with pytest.raises(ValidationError, match=complaint):
        Server.create(host_maddrs=LOOPBACK, **options)


def test_a_server_cannot_start_twice_and_shutdown_is_idempotent():
    server = Server.create(
        expert_uids=["nop.0"], expert_cls="nop", hidden_dim=2, host_maddrs=LOOPBACK
    )
    try:
        server.run_in_background()
        with pytest.raises(ValidationError, match="cannot start: it is already started"):
            server.run_in_background()
    finally:
        server.shutdown()
        server.shutdown()
    assert not server.runtime.is_alive


@pytest.mark.parametrize("yields_before_shutdown", [0, 1, 5])
def test_shutting_down_while_starting_leaves_nothing_running(arun, yields_before_shutdown):
    async def main():
        peer = await Peer.create()
        node = await DHTNode.create(peer, [])
        schema = BatchTensorDescriptor(4)
        backend = ModuleBackend("f.0", torch.nn.Identity(), args_schema=schema)
        server = Server(SimpleNamespace(peer=peer, node=node), {"f.0": backend})
        try:
            starting = asyncio.ensure_future(server.astart())
            for _ in range(yields_before_shutdown):
                await asyncio.sleep(0)
            await server.ashutdown()
            (outcome,) = await asyncio.gather(starting, return_exceptions=True)
            if yields_before_shutdown == 0:  # stopped before it began: starting is refused
                assert isinstance(outcome, ValidationError)
            assert server.declarer is None and not server.runtime.is_alive
            assert protocol.FORWARD not in peer._handlers
        finally:
            await node.shutdown()
            await peer.shutdown()

    arun(main)
