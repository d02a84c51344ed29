"""``swarmgrad train``: join a collaborative training run without writing the loop.

Example::

    swarmgrad train --model-module my_model.py --run-id my-run --initial-peers ADDR \\
                    --target-batch-size 4096 --batch-size 32 --checkpoint-dir ckpt/

The model module defines ``make_model()``, ``loss_fn(model, batch)`` and either
``batches(batch_size, seed)`` or ``make_dataset()``, optionally ``make_optimizer(params)``
and ``configure(options)`` (see ``swarmgrad.cli.model_module``). The trainer runs the
usual loop around a collaborative ``swarmgrad.Optimizer``: every peer with the same
``--run-id`` trains the same model, stepping together each time the swarm has processed
``--target-batch-size`` samples.

With ``--checkpoint-dir`` it saves the model, the optimizer state and the epoch every
``--checkpoint-every`` epochs and when it stops, and a restart resumes from there (then,
if the swarm has moved on, it downloads the newer state from the peers). ``--config
FILE`` reads the options from JSON, TOML or YAML, as ``swarmgrad server`` does
(``module_options`` as a table); flags on the command line override the file.

It stops after ``--epochs`` global epochs, or on SIGINT/SIGTERM (saving a checkpoint
first), with code 0. A bad model module or option exits with code 2 and a message naming
what was wrong; a failure to join the swarm with code 1. ``--progress-json`` prints one
JSON line per event on stdout (``ready``, ``epoch``, ``done``) for programs that watch
the trainer (``swarmgrad demo`` does).
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

from swarmgrad.cli.config_file import config_tokens, load_config
from swarmgrad.cli.dht_command import admission_kwargs
from swarmgrad.utils.logging import use_swarmgrad_log_handler

logger = logging.getLogger("swarmgrad.cli.train")

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2

#: defaults of every option (argparse keeps only what was given, so that the config file
#: fills the gaps without overriding the command line)
DEFAULTS: dict[str, Any] = {
    "config": None,
    "model_module": None,
    "module_options": [],
    "run_id": None,
    "initial_peers": [],
    "target_batch_size": 4096,
    "batch_size": 32,
    "epochs": None,
    "seed": None,
    "matchmaking_time": 5.0,
    "averaging_timeout": 30.0,
    "metadata_expiration": 60.0,
    "use_local_updates": False,
    "client_mode": False,
    "metrics_period": 30.0,
    "checkpoint_dir": None,
    "checkpoint_every": 5,
    "host_maddrs": ["/ip4/0.0.0.0/tcp/0"],
    "announce_maddrs": [],
    "identity_path": None,
    "authority_key": None,
    "access_token": None,
    "progress_json": False,
    "log_level": "INFO",
}


def add_parser(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "train",
        help="train a model from a Python module together with a swarm",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        argument_default=argparse.SUPPRESS,
    )
    group: Any = parser

    def option(name: str, **kwargs: Any) -> None:
        flags = [f"--{name}"]
        if "-" in name:
            flags.append(f"--{name.replace('-', '_')}")
        dest = name.replace("-", "_")
        if "help" in kwargs and DEFAULTS.get(dest) not in (None, [], False):
            kwargs["help"] += f" (default: {DEFAULTS[dest]})"
        group.add_argument(*flags, dest=dest, **kwargs)

    option("config", help="JSON, TOML or YAML file with any of these options")
    group = parser.add_argument_group("what to train")
    option("model-module", help="Python file defining make_model, loss_fn and the data")
    option("module-options", nargs="*", metavar="KEY=VALUE", help="passed to its configure()")
    option("run-id", help="peers with the same run id train together")
    option("target-batch-size", type=int, help="samples the swarm processes per global step")
    option("batch-size", type=int, help="samples per local step")
    option("epochs", type=int, help="stop after this many global epochs (default: never)")
    option("seed", type=int, help="seed of this peer's data order (default: random)")
    group = parser.add_argument_group("collaboration")
    option("matchmaking-time", type=float, help="seconds to gather peers for averaging")
    option("averaging-timeout", type=float, help="seconds an averaging round may take")
    option("metadata-expiration", type=float, help="seconds a dead peer's progress still counts")
    option("use-local-updates", action="store_true", help="step locally, average parameters")
    option("client-mode", action="store_true", help="accept no connections (behind NAT)")
    option(
        "metrics-period",
        type=float,
        help="seconds between this peer's metrics records for swarmgrad monitor (0: none)",
    )
    group = parser.add_argument_group("checkpoints")
    option("checkpoint-dir", help="save to and resume from this directory")
    option("checkpoint-every", type=int, help="epochs between checkpoints")
    group = parser.add_argument_group("network and DHT")
    option("initial-peers", nargs="*", help="multiaddrs of peers already in the swarm")
    option("host-maddrs", nargs="+", help="addresses to listen on (tcp/0 picks a port)")
    option("announce-maddrs", nargs="*", help="public addresses to advertise (behind NAT)")
    option("identity-path", help="ed25519 key file (created if missing): a stable PeerID")
    option("authority-key", help="admit only peers with tokens from this authority")
    option("access-token", help="this peer's token file (swarmgrad authority issue)")
    group = parser.add_argument_group("output")
    option("progress-json", action="store_true", help="one JSON line per event on stdout")
    option("log-level", help="DEBUG, INFO, WARNING, ...")
    parser.set_defaults(run=run, train_parser=parser)


# ---------------------------------------------------------------------- settings


def resolve_settings(args: argparse.Namespace) -> dict[str, Any]:
    """Defaults, then the config file, then the command line; refuses what cannot work."""
    given = {k: v for k, v in vars(args).items() if k not in ("run", "train_parser", "command")}
    settings = dict(DEFAULTS)
    if given.get("config"):
        tokens = config_tokens(load_config(given["config"]), given["config"], DEFAULTS)
        from_file = vars(args.train_parser.parse_args(tokens))
        settings.update({k: v for k, v in from_file.items() if k in DEFAULTS})
    settings.update(given)
    for key in ("initial_peers", "host_maddrs", "announce_maddrs", "module_options"):
        if isinstance(settings[key], str):
            settings[key] = [settings[key]]
    for key in ("model_module", "run_id"):
        if not settings[key]:
            raise ValueError(f"--{key.replace('_', '-')} is required")
    for key in ("target_batch_size", "batch_size", "checkpoint_every", "metadata_expiration"):
        if settings[key] <= 0:
            raise ValueError(f"--{key.replace('_', '-')} must be positive, got {settings[key]}")
    if settings["metrics_period"] < 0:
        raise ValueError(f"--metrics-period must be 0 or more, got {settings['metrics_period']}")
    if settings["epochs"] is not None and settings["epochs"] <= 0:
        raise ValueError(f"--epochs must be positive, got {settings['epochs']}")
    settings["module_options"] = parse_module_options(settings["module_options"])
    return settings


def parse_module_options(items: list[str]) -> dict[str, str]:
    options = {}
    for item in items:
        key, sep, value = str(item).partition("=")
        if not sep or not key:
            raise ValueError(f"--module-options takes KEY=VALUE items, got {item!r}")
        options[key] = value
    return options


# ---------------------------------------------------------------------- running


def _usage_error(message: str) -> int:
    print(f"swarmgrad train: error: {message}", file=sys.stderr, flush=True)
    return EXIT_USAGE


def run(args: argparse.Namespace) -> int:
    from swarmgrad.cli.model_module import load_model_module

    try:  # everything checkable before joining the swarm
        settings = resolve_settings(args)
        module = load_model_module(settings["model_module"], settings["module_options"])
    except ValueError as e:  # ModelModuleError and ValidationError are ValueErrors
        return _usage_error(str(e))
    use_swarmgrad_log_handler(str(settings["log_level"]).upper())
    stop = threading.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: stop.set())
    return Trainer(module, settings, stop).run()


class Trainer:
    """The loop: batches -> loss -> backward -> collaborative step, with checkpoints."""

    def __init__(self, module: Any, settings: dict[str, Any], stop: threading.Event):
        self.module, self.settings, self.stop = module, settings, stop
        self.seed = settings["seed"]
        if self.seed is None:
            self.seed = int.from_bytes(os.urandom(4), "little")

    def say(self, event: str, **fields: Any) -> None:
        if self.settings["progress_json"]:
            print(json.dumps({"event": event, "time": time.time(), **fields}), flush=True)

    def run(self) -> int:
        import torch

        from swarmgrad.cli.model_module import ModelModuleError
        from swarmgrad.cli.train_checkpoint import load_checkpoint
        from swarmgrad.dht import DHT
        from swarmgrad.utils.errors import SwarmgradError

        s = self.settings
        try:
            torch.manual_seed(0)  # every peer builds the same initial weights
            try:
                model = self.module.make_model()
            except Exception as e:
                raise ValueError(
                    f"model module {s['model_module']!r}: make_model() failed: "
                    f"{type(e).__name__}: {e}"
                ) from e
            if not isinstance(model, torch.nn.Module):
                raise ValueError(
                    f"model module {s['model_module']!r}: make_model() returned "
                    f"{type(model).__name__}, not a torch.nn.Module"
                )
            checkpoint = load_checkpoint(s["checkpoint_dir"]) if s["checkpoint_dir"] else None
            if checkpoint is not None:
                try:
                    model.load_state_dict(checkpoint["model"])
                except RuntimeError as e:
                    raise ValueError(
                        f"checkpoint in {s['checkpoint_dir']!r} does not fit the model of "
                        f"{s['model_module']!r}: {e}"
                    ) from e
        except ValueError as e:
            return _usage_error(str(e))
        try:
            dht = DHT(
                initial_peers=s["initial_peers"],
                host_maddrs=s["host_maddrs"],
                announce_maddrs=s["announce_maddrs"],
                identity_path=s["identity_path"],
                client_mode=s["client_mode"],
                start=True,
                **admission_kwargs(s["authority_key"], s["access_token"]),
            )
        except (SwarmgradError, OSError, ValueError) as e:
            print(f"swarmgrad train: could not join the swarm: {e}", file=sys.stderr, flush=True)
            return EXIT_FAILED
        try:
            return self._train(dht, model, checkpoint)
        except ModelModuleError as e:  # found out only once training began (e.g. no data)
            return _usage_error(str(e))
        finally:
            dht.shutdown()

    def _make_optimizer(self, dht: Any, model: Any) -> Any:
        import torch

        from swarmgrad.optim import Optimizer

        s = self.settings
        factory = self.module.make_optimizer or (lambda params: torch.optim.Adam(params, lr=1e-3))
        return Optimizer(
            dht=dht,
            run_id=s["run_id"],
            target_batch_size=s["target_batch_size"],
            batch_size_per_step=s["batch_size"],
            optimizer=factory,
            params=model.parameters(),
            matchmaking_time=s["matchmaking_time"],
            averaging_timeout=s["averaging_timeout"],
            tracker_opts={"metadata_expiration": s["metadata_expiration"]},
            use_local_updates=s["use_local_updates"],
            client_mode=s["client_mode"],
            metrics=self._metrics_options(),
        )

    def _metrics_options(self) -> dict | bool:
        """The Optimizer's metrics publisher: a dead peer's record lives as long as its
        progress record (--metadata-expiration), at least three periods."""
        period = self.settings["metrics_period"]
        if not period > 0:
            return False
        return {
            "period": period,
            "expiration": max(3 * period, self.settings["metadata_expiration"]),
        }

    def _train(self, dht: Any, model: Any, checkpoint: dict | None) -> int:
        from swarmgrad.cli.train_checkpoint import save_checkpoint

        s = self.settings
        opt = self._make_optimizer(dht, model)
        try:
            samples = 0
            if checkpoint is not None:
                opt.load_state_dict(checkpoint["optimizer"])
                samples = int(checkpoint.get("samples", 0))
                logger.info("resumed from %s at epoch %d", s["checkpoint_dir"], opt.local_epoch)
            maddrs = [str(m) for m in dht.get_visible_maddrs()]
            resumed = None if checkpoint is None else opt.local_epoch
            self.say("ready", pid=os.getpid(), maddrs=maddrs, resumed_epoch=resumed)
            if maddrs and not s["progress_json"]:
                print(f"Training. To join, use --initial-peers {' '.join(maddrs)}", flush=True)
            logger.info("training %s in run %r; this peer: %s", s["model_module"], s["run_id"],
                        " ".join(maddrs) or "client mode")  # fmt: skip
            last_epoch, saved_epoch = opt.local_epoch, opt.local_epoch
            losses: list[float] = []
            window_began, window_samples = time.monotonic(), 0
            for batch in self._batches():
                if self.stop.is_set() or self._finished(opt):
                    break
                loss = self.module.loss_fn(model, batch)
                loss.backward()
                opt.step()
                opt.zero_grad()
                losses.append(float(loss.detach()))
                opt.report(losses[-1])  # for swarmgrad monitor
                samples += s["batch_size"]
                window_samples += s["batch_size"]
                if opt.local_epoch != last_epoch:
                    last_epoch = opt.local_epoch
                    progress = opt.tracker.global_progress
                    elapsed = max(time.monotonic() - window_began, 1e-9)
                    loss_mean = sum(losses) / len(losses) if losses else None
                    self.say(
                        "epoch", epoch=last_epoch, global_epoch=progress.epoch,
                        peers=progress.num_peers, loss=loss_mean, samples=samples,
                        samples_per_s=window_samples / elapsed,
                    )  # fmt: skip
                    logger.info("epoch %d: loss %.4f, %d peers, %.1f samples/s",
                                last_epoch, loss_mean or float("nan"), progress.num_peers,
                                window_samples / elapsed)  # fmt: skip
                    losses, window_began, window_samples = [], time.monotonic(), 0
                    if s["checkpoint_dir"] and last_epoch - saved_epoch >= s["checkpoint_every"]:
                        save_checkpoint(s["checkpoint_dir"], model, opt, samples=samples)
                        saved_epoch = last_epoch
            if s["checkpoint_dir"]:
                path = save_checkpoint(s["checkpoint_dir"], model, opt, samples=samples)
                logger.info("saved %s at epoch %d", path, opt.local_epoch)
            self.say("done", epoch=opt.local_epoch, samples=samples)
            return EXIT_OK
        finally:
            opt.shutdown()

    def _finished(self, opt: Any) -> bool:
        return self.settings["epochs"] is not None and opt.local_epoch >= self.settings["epochs"]

    def _batches(self) -> Iterator[Any]:
        """The module's batches, started again whenever they run out."""
        from swarmgrad.cli.model_module import ModelModuleError

        module, s = self.module, self.settings
        for round_ in itertools.count():
            if module.batches is not None:
                source = module.batches(s["batch_size"], self.seed + round_)
            else:
                import torch

                generator = torch.Generator().manual_seed(self.seed + round_)
                source = torch.utils.data.DataLoader(
                    module.make_dataset(), batch_size=s["batch_size"], shuffle=True,
                    drop_last=True, generator=generator,
                )  # fmt: skip
            empty = True
            for batch in source:
                empty = False
                yield batch
            if empty:
                raise ModelModuleError(
                    f"model module {s['model_module']!r}: its data gave no batch of "
                    f"{s['batch_size']} samples"
                )
