"""hivemind's ``hivemind.proto`` (the alias maps it here, next to the codecs).

swarmgrad's wire messages are msgpack dataclasses (each protocol's ``protocol.py``), not
protobufs; what programs take from here is the ``runtime_pb2.CompressionType`` enum they
pass to servers and serializers."""
