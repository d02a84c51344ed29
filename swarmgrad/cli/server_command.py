"""``swarmgrad server``: host experts of a decentralized mixture-of-experts.

Example::

    swarmgrad server --expert-cls ffn --hidden-dim 512 --num-experts 8 \\
                     --expert-pattern "expert.[0:32].[0:32]" --initial-peers ADDR

Every multi-word flag is also accepted in hivemind's spelling (``--expert_cls``).
``--config FILE`` reads the same options from a JSON, TOML or YAML file (YAML through PyYAML,
a dependency), keys spelled either way (``expert-cls`` or ``expert_cls``); flags on the
command line override the file.

Once serving, it prints two lines on stdout (scripts can parse them)::

    Serving 8 ffn experts (hidden_dim 512): expert.3.17 expert.20.4 ...
    Running an expert server. To join, use --initial-peers MADDR [MADDR ...]

where each MADDR is a full multiaddr ``/ip4/.../tcp/N/p2p/<PeerID>``, then one indented
line per multiaddr. It logs a status line every ``--stats-report-interval`` seconds and,
on SIGINT or SIGTERM, withdraws its experts from the DHT, saves checkpoints (with
``--checkpoint-dir``) and exits with code 0. Invalid options (a malformed
``--expert-pattern``, an unknown ``--expert-cls``, ...) exit with code 2; a failure to
start (e.g. no initial peer answers) with code 1.
"""

from __future__ import annotations

import argparse
import logging
import sys
from functools import partial
from typing import Any

from swarmgrad.cli.common import EXIT_FAILED, EXIT_OK, stop_on_signals, usage_error
from swarmgrad.cli.config_file import (
    add_configurable_command,
    add_network_options,
    layered_settings,
)
from swarmgrad.cli.dht_command import admission_kwargs
from swarmgrad.utils.logging import use_swarmgrad_log_handler

logger = logging.getLogger("swarmgrad.cli.server")


#: defaults of every option (argparse itself keeps only what was given, so the config
#: file can fill the gaps without overriding the command line)
DEFAULTS: dict[str, Any] = {
    "config": None,
    "num_experts": None,
    "expert_uids": None,
    "expert_pattern": None,
    "expert_cls": "ffn",
    "hidden_dim": 1024,
    "optimizer": "adam",
    "scheduler": "none",
    "num_warmup_steps": None,
    "num_training_steps": None,
    "clip_grad_norm": None,
    "min_batch_size": 1,
    "max_batch_size": 4096,
    "batch_timeout": 0.05,
    "device": None,
    "compression": "none",
    "checkpoint_dir": None,
    "checkpoint_interval": None,
    "keep_checkpoints": 5,
    "stats_report_interval": 30.0,
    "metrics_run_id": "experts",
    "metrics_period": 10.0,
    "custom_module_path": None,
    "update_period": 30.0,
    "expiration": None,
    "activation_cache_mb": 512.0,
    "initial_peers": [],
    "host_maddrs": ["/ip4/0.0.0.0/tcp/0"],
    "announce_maddrs": [],
    "identity_path": None,
    "authority_key": None,
    "access_token": None,
    "num_handlers": None,
    "increase_file_limit": False,
    "use_relay": True,
    "use_auto_relay": False,
    "log_level": "INFO",
}


def _compression(text: str) -> str:
    from swarmgrad.compression.serialized import CompressionType

    for member in CompressionType:
        if text.lower() in (member.value, member.name.lower()):
            return member.value
    known = ", ".join(m.value for m in CompressionType)
    raise argparse.ArgumentTypeError(f"unknown compression {text!r}; expected one of {known}")


def add_parser(commands: argparse._SubParsersAction) -> None:
    option = add_configurable_command(
        commands,
        "server",
        help="host experts of a decentralized mixture-of-experts",
        doc=__doc__,
        defaults=DEFAULTS,
    )
    parser = option.parser
    option.group("experts")
    option("num-experts", type=int, help="how many experts to host (with --expert-pattern)")
    option("expert-uids", nargs="+", help="exact uids to host, e.g. expert.0 expert.1")
    option("expert-pattern", help='uid pattern to sample from, e.g. "expert.[0:32].[0:32]"')
    option("expert-cls", help="expert class: ffn, transformer, det_dropout, nop or custom")
    option("hidden-dim", type=int, help="hidden size of each expert")
    option("custom-module-path", help="Python file whose register_expert_class calls add classes")
    option.group("training")
    option("optimizer", choices=["adam", "sgd", "none"], help="each expert's optimizer")
    option("scheduler", choices=["linear", "none"], help="learning-rate schedule")
    option("num-warmup-steps", type=int, help="warmup steps of the linear scheduler")
    option("num-training-steps", type=int, help="steps until the linear scheduler reaches 0")
    option("clip-grad-norm", type=float, help="clip each expert's gradient norm to this")
    option.group("batching and compute")
    option("min-batch-size", type=int, help="samples a batch waits for (up to --batch-timeout)")
    option("max-batch-size", type=int, help="largest batch (and request) in samples")
    option("batch-timeout", type=float, help="seconds a batch waits to reach --min-batch-size")
    option("device", help="torch device, e.g. cpu or cuda:0 (default: cuda if available)")
    option("compression", type=_compression, help="codec of outputs and gradients sent back")
    option("activation-cache-mb", type=float, help="memory for forward graphs awaiting backward")
    option.group("checkpoints")
    option("checkpoint-dir", help="restore experts from and save them to this directory")
    option("checkpoint-interval", type=float, help="seconds between checkpoints")
    option("keep-checkpoints", type=int, help="newest checkpoints kept per expert")
    add_network_options(option, "server")
    option.current.add_argument(
        "--no-relay",
        "--no_relay",
        dest="use_relay",
        action="store_false",
        help="do not use relays (hivemind's flag; a client-mode server then cannot be called)",
    )
    option("use-auto-relay", action="store_true", help="use relays among the initial peers")
    option("update-period", type=float, help="seconds between re-declarations in the DHT")
    option("expiration", type=float, help="lifetime of a declaration (default 2 x period, >= 60)")
    option.group("misc")
    option("stats-report-interval", type=float, help="seconds between status log lines")
    option("metrics-run-id", help="run under which swarmgrad monitor lists this server")
    option(
        "metrics-period",
        type=float,
        help="seconds between metrics records for the monitor (0: none)",
    )
    option("num-handlers", type=int, help="accepted for hivemind compatibility; unused")
    option("increase-file-limit", action="store_true", help="hivemind compatibility; unused")
    option("log-level", help="DEBUG, INFO, WARNING, ...")
    parser.set_defaults(run=run, server_parser=parser)


# ---------------------------------------------------------------------- settings


def resolve_settings(args: argparse.Namespace) -> dict[str, Any]:
    """Defaults, then the config file, then the command line."""
    settings, _ = layered_settings(args, args.server_parser, DEFAULTS)
    return settings


def server_kwargs(settings: dict[str, Any]) -> dict[str, Any]:
    """Server.create's arguments from the resolved settings."""
    import torch

    optimizers = {"adam": torch.optim.Adam, "sgd": torch.optim.SGD, "none": None}
    return dict(
        num_experts=settings["num_experts"],
        expert_uids=settings["expert_uids"],
        expert_pattern=settings["expert_pattern"],
        expert_cls=settings["expert_cls"],
        hidden_dim=settings["hidden_dim"],
        optim_cls=optimizers[settings["optimizer"]],
        scheduler=settings["scheduler"],
        num_warmup_steps=settings["num_warmup_steps"],
        num_training_steps=settings["num_training_steps"],
        clip_grad_norm=settings["clip_grad_norm"],
        num_handlers=settings["num_handlers"],
        min_batch_size=settings["min_batch_size"],
        max_batch_size=settings["max_batch_size"],
        batch_timeout=settings["batch_timeout"],
        device=settings["device"],
        initial_peers=settings["initial_peers"],
        checkpoint_dir=settings["checkpoint_dir"],
        checkpoint_interval=settings["checkpoint_interval"],
        keep_checkpoints=settings["keep_checkpoints"],
        compression=settings["compression"],
        stats_report_interval=settings["stats_report_interval"],
        activation_cache_bytes=int(settings["activation_cache_mb"] * 1024 * 1024),
        custom_module_path=settings["custom_module_path"],
        update_period=settings["update_period"],
        expiration=settings["expiration"],
        host_maddrs=settings["host_maddrs"],
        announce_maddrs=settings["announce_maddrs"],
        identity_path=settings["identity_path"],
        # hivemind's relay flags, mapped by swarmgrad.net.libp2p_options in the DHT
        **({} if settings["use_relay"] else {"use_relay": False}),
        **({"use_auto_relay": True} if settings["use_auto_relay"] else {}),
        **admission_kwargs(settings["authority_key"], settings["access_token"]),
    )


# ---------------------------------------------------------------------- running


def check_settings(settings: dict[str, Any]) -> None:
    """Refuse options that cannot work (ValidationError) before starting anything."""
    from swarmgrad.moe.server import parse_expert_pattern
    from swarmgrad.moe.server.layers import load_custom_module, name_to_block

    if settings["expert_pattern"] is not None:
        parse_expert_pattern(settings["expert_pattern"])
    if settings["custom_module_path"] is not None:
        load_custom_module(settings["custom_module_path"])
        settings["custom_module_path"] = None  # loaded once is enough
    if settings["expert_cls"] not in name_to_block:
        raise ValueError(
            f"unknown expert class {settings['expert_cls']!r}; known: {sorted(name_to_block)} "
            "(add more with --custom-module-path)"
        )
    if settings["expert_uids"] is None and settings["num_experts"] is None:
        raise ValueError(
            "give --expert-uids, or --num-experts (with --expert-pattern, or without one for "
            "expert.0, expert.1, ... as in hivemind)"
        )
    if settings["metrics_period"] < 0:
        raise ValueError(f"--metrics-period must be 0 or more, got {settings['metrics_period']}")
    run_id = settings["metrics_run_id"]
    if not isinstance(run_id, str) or not 0 < len(run_id) <= 128:
        raise ValueError(f"--metrics-run-id must have 1 to 128 characters, got {run_id!r}")


_usage_error = partial(usage_error, "server")


def run(args: argparse.Namespace) -> int:
    from swarmgrad.moe.server import Server
    from swarmgrad.optim.metrics import MetricsPublisher
    from swarmgrad.utils.errors import SwarmgradError, ValidationError

    try:  # everything checkable up front, before touching signals or logging
        settings = resolve_settings(args)
        check_settings(settings)
    except ValueError as e:  # ValidationError is a ValueError too
        return _usage_error(str(e))
    use_swarmgrad_log_handler(str(settings["log_level"]).upper())

    stop = stop_on_signals()
    try:
        server = Server.create(start=True, **server_kwargs(settings))
    except ValidationError as e:
        return _usage_error(str(e))
    except (SwarmgradError, OSError, ValueError, RuntimeError) as e:
        print(f"swarmgrad server: could not start: {e}", file=sys.stderr, flush=True)
        return EXIT_FAILED
    publisher = None
    try:
        if settings["metrics_period"] > 0:
            publisher = MetricsPublisher(
                server.dht,
                settings["metrics_run_id"],
                partial(expert_server_metrics, server),
                period=settings["metrics_period"],
            )
        uids = list(server.module_backends)
        print(
            f"Serving {len(uids)} {settings['expert_cls']} experts "
            f"(hidden_dim {settings['hidden_dim']}): {' '.join(uids)}",
            flush=True,
        )
        maddrs = [str(m) for m in server.dht.get_visible_maddrs()]
        print(f"Running an expert server. To join, use --initial-peers {' '.join(maddrs)}")
        for maddr in maddrs:
            print(f"  {maddr}")
        sys.stdout.flush()
        interval = settings["stats_report_interval"] or 30.0
        while not stop.wait(interval):
            _log_status(server)
    finally:
        print("Shutting down", flush=True)
        if publisher is not None:
            publisher.shutdown()
        server.shutdown()
    return EXIT_OK


def expert_server_metrics(server: Any) -> dict[str, Any]:
    """The fields of an expert server's metrics record (for swarmgrad monitor)."""
    backends = list(server.module_backends.values())
    return {
        "role": "server",
        "experts": list(server.module_backends),
        "expert_batches": sum(
            b.forward_pool.stats.batches + b.backward_pool.stats.batches for b in backends
        ),
    }


def _log_status(server: Any) -> None:
    backends = server.module_backends.values()
    forward = sum(b.forward_pool.stats.batches for b in backends)
    backward = sum(b.backward_pool.stats.batches for b in backends)
    samples = sum(b.forward_pool.stats.samples for b in backends)
    updates = sum(b.update_count for b in backends)
    declared = server.declarer.declarations if server.declarer is not None else 0
    logger.info(
        "%d experts: %d forward batches (%d samples), %d backward batches, %d updates; "
        "%d declaration rounds; %d connections",
        len(server.module_backends), forward, samples, backward, updates, declared,
        len(server.dht.peer.connected_peers),
    )  # fmt: skip
