"""The Kademlia DHT: peers find each other, experts, averaging groups and training progress.

``DHT`` is the synchronous facade (hivemind's user-facing class); ``DHTNode`` the
asyncio node it runs; validators protect records (ed25519 ownership, pydantic schemas).
Nothing here imports torch, so a DHT-only peer stays small.
"""

from typing import Any

from swarmgrad.dht.crypto import Ed25519SignatureValidator, RSASignatureValidator
from swarmgrad.dht.dht import DHT
from swarmgrad.dht.node import DHTNode
from swarmgrad.dht.routing import DHTID
from swarmgrad.dht.schema import SchemaValidator
from swarmgrad.dht.storage import DictionaryDHTValue, ValueWithExpiration
from swarmgrad.dht.validation import CompositeValidator, DHTRecord, RecordValidatorBase

DHTValue = Any  # hivemind's name: any msgpack-able value stored in the DHT

__all__ = [
    "DHT",
    "DHTID",
    "CompositeValidator",
    "DHTNode",
    "DHTRecord",
    "DHTValue",
    "DictionaryDHTValue",
    "Ed25519SignatureValidator",
    "RSASignatureValidator",
    "RecordValidatorBase",
    "SchemaValidator",
    "ValueWithExpiration",
]
