"""Command-line entry points of ``swarmgrad`` (see ``swarmgrad --help``): ``dht`` (a
bootstrap / relay peer), ``server`` (expert server), ``serve-stage`` (a stage of a SWARM
pipeline), ``train`` (a trainer peer),
``monitor`` (dashboard and Prometheus endpoint), ``demo`` (small local swarms) and
``authority`` (admission keys, tokens and revocations), one module each."""
