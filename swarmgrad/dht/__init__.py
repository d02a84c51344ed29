"""The distributed hash table: Kademlia routing, storage, record validators, the DHT facade."""
