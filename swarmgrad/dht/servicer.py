"""What a DHT node answers: ``dht.ping``, ``dht.store`` and ``dht.find``.

:class:`DHTServicer` is the serving part of :class:`~swarmgrad.dht.node.DHTNode`: a
:class:`~swarmgrad.net.rpc.ServicerBase` whose ``rpc_*`` methods are the DHT's protocol,
answering from the node's own routing table and storage (hence a part of the node, not
an object beside it). Messages are decoded and encoded by :mod:`swarmgrad.dht.protocol`;
a node in client mode serves none of them.
"""

from __future__ import annotations

from typing import Any

from swarmgrad.dht import protocol
from swarmgrad.dht.protocol import FindAnswer
from swarmgrad.dht.records import fit_record, newer_than, record_size
from swarmgrad.dht.replication import DHTReplication
from swarmgrad.dht.routing import DHTID
from swarmgrad.net.rpc import RPCContext, ServicerBase


class DHTServicer(ServicerBase, DHTReplication):
    """The ``dht.*`` handlers of a :class:`~swarmgrad.dht.node.DHTNode`."""

    rpc_prefix = "dht"

    async def rpc_ping(self, request: Any, context: RPCContext) -> dict:
        self._heard_from(context.remote_id, request)
        return protocol.encode_pong(self.time_fn(), self.client_mode)

    async def rpc_store(self, request: Any, context: RPCContext) -> dict:
        items = protocol.decode_store(request)
        self._heard_from(context.remote_id, request.get("sender"))
        results = [self._store_locally(item, context.remote_id) for item in items]
        return protocol.encode_store_result(results)

    async def rpc_find(self, request: Any, context: RPCContext) -> dict:
        key_ids = protocol.decode_find(request)
        k = protocol.requested_neighbors(request, self.bucket_size)
        skipped = protocol.skipped_records(request, len(key_ids))
        known = protocol.known_versions(request, len(key_ids))
        known_nodes = protocol.known_node_prefixes(request, len(key_ids))
        self._heard_from(context.remote_id, request.get("sender"))
        requester = DHTID.for_peer(context.remote_id)
        entries = self._answer_entries_now()
        answers = []
        budget = protocol.MAX_ANSWER_RECORD_BYTES
        for index, key_id in enumerate(key_ids):
            nearest = self.routing.get_nearest_neighbors(key_id, k, exclude=requester)
            if index in known_nodes:
                skip_nodes = known_nodes[index]
                prefix = protocol.node_prefix
                nearest = [(n, p) for n, p in nearest if prefix(n) not in skip_nodes]
            record = None
            if index not in skipped:
                record = newer_than(self._local_record(key_id), known.get(index))
                record = fit_record(record, budget)
            budget -= record_size(record)
            listed = [entries.get(p) or self._answer_entry(p) for _, p in nearest]
            answers.append(FindAnswer(record, tuple(listed)))
        return protocol.encode_find_result(answers)


__all__ = ["DHTServicer"]
