"""State transfer for joining peers: donors share their state, newcomers download it.

An averager owns a :class:`StateSharing` (the donor side: a DHT declaration with a
priority, and RPCs serving a snapshot chunk by chunk) and calls
:func:`load_state_from_peers` when it joins late (the downloader: chunks from several
donors at once, each checked against a SHA-256 digest, failing, busy, slow or lying
donors replaced by others)::

    sharing = StateSharing(peer, dht_node, prefix="run42", get_state=get_current_state,
                           priority=lambda: local_epoch)
    sharing.start()                                       # on the event loop
    ...
    state = await load_state_from_peers(peer, dht_node, prefix="run42", timeout=60)
    if state is not None:
        metadata, tensors = state
    ...
    await sharing.shutdown()

The pieces: :mod:`.protocol` (DHT records, RPC names), :mod:`.chunks`
(manifests, snapshots, verified assembly), :mod:`.scheduler` (which donor fetches
which chunk), :mod:`.sharing` (donor) and :mod:`.download` (downloader).
"""

from swarmgrad.averaging.state.chunks import (
    DEFAULT_CHUNK_SIZE,
    CorruptChunk,
    StateAssembler,
    StateManifest,
    StateSnapshot,
)
from swarmgrad.averaging.state.download import StateDownloader, load_state_from_peers
from swarmgrad.averaging.state.protocol import (
    DonorRecord,
    declaration_key,
    order_donors,
    parse_declarations,
)
from swarmgrad.averaging.state.sharing import SharingStats, StateSharing

__all__ = [
    "DEFAULT_CHUNK_SIZE",
    "CorruptChunk",
    "DonorRecord",
    "SharingStats",
    "StateAssembler",
    "StateDownloader",
    "StateManifest",
    "StateSharing",
    "StateSnapshot",
    "declaration_key",
    "load_state_from_peers",
    "order_donors",
    "parse_declarations",
]
