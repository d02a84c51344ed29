"""Command-line entry points: ``swarmgrad dht`` (bootstrap / relay peer), more to come."""
