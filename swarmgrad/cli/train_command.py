"""``swarmgrad train``: join a collaborative training run without writing the loop.

Example::

    swarmgrad train --model-module my_model.py --run-id my-run --initial-peers ADDR \\
                    --target-batch-size 4096 --batch-size 32 --checkpoint-dir ckpt/

The model module defines ``make_model()``, ``loss_fn(model, batch)`` and either
``batches(batch_size, seed)`` or ``make_dataset()``, optionally ``make_optimizer(params)``,
``make_scheduler(optimizer)`` and ``configure(options)`` (see
``swarmgrad.cli.model_module``). The trainer runs the usual loop around a collaborative
``swarmgrad.Optimizer``: every peer with the same ``--run-id`` trains the same model,
stepping together each time the swarm has processed ``--target-batch-size`` samples.

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
import sys
import threading
import time
from collections.abc import Iterator
from functools import partial
from typing import Any

from swarmgrad.cli.common import EXIT_FAILED, EXIT_OK, stop_on_signals, usage_error
from swarmgrad.cli.config_file import (
    add_configurable_command,
    add_network_options,
    layered_settings,
)
from swarmgrad.cli.dht_command import admission_kwargs
from swarmgrad.cli.train_options import COMPRESSIONS, MODES, PRECISIONS, check_run_options
from swarmgrad.utils.logging import use_swarmgrad_log_handler

logger = logging.getLogger("swarmgrad.cli.train")


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
    "device": "auto",
    "precision": "fp32",
    "mode": "sync",
    "inner_steps": 100,
    "fragments": None,
    "outer_compression": "none",
    "powersgd_rank": None,
    "grad_compression": "none",
    "offload": None,
    "delay": False,
    "clip_grad_norm": None,
    "grad_accumulation": 1,
    "checkpoint_dir": None,
    "checkpoint_every": 5,
    "keep_checkpoints": 2,
    "role": "trainer",
    "keep_every": 1,
    "host_maddrs": ["/ip4/0.0.0.0/tcp/0"],
    "announce_maddrs": [],
    "identity_path": None,
    "authority_key": None,
    "access_token": None,
    "progress_json": False,
    "tensorboard": None,
    "wandb": None,
    "log_level": "INFO",
}


def add_parser(commands: argparse._SubParsersAction) -> None:
    option = add_configurable_command(
        commands,
        "train",
        help="train a model from a Python module together with a swarm",
        doc=__doc__,
        defaults=DEFAULTS,
    )
    parser = option.parser
    option.group("what to train")
    option("model-module", help="Python file defining make_model, loss_fn and the data")
    option("module-options", nargs="*", metavar="KEY=VALUE", help="passed to its configure()")
    option("run-id", help="peers with the same run id train together")
    option(
        "role", choices=("trainer", "keeper"),
        help="keeper: train nothing; download the swarm's state every --keep-every epochs, "
        "save it to --checkpoint-dir and serve it to joiners",
    )  # fmt: skip
    option("keep-every", type=int, help="keeper: epochs between two saved states")
    option("target-batch-size", type=int, help="samples the swarm processes per global step")
    option("batch-size", type=int, help="samples per local step")
    option("epochs", type=int, help="stop after this many global epochs (default: never)")
    option("seed", type=int, help="seed of this peer's data order (default: random)")
    option.group("collaboration")
    option("matchmaking-time", type=float, help="seconds to gather peers for averaging")
    option("averaging-timeout", type=float, help="seconds an averaging round may take")
    option("metadata-expiration", type=float, help="seconds a dead peer's progress still counts")
    option("use-local-updates", action="store_true", help="the same as --mode local")
    option("client-mode", action="store_true", help="accept no connections (behind NAT)")
    option(
        "metrics-period",
        type=float,
        help="seconds between this peer's metrics records for swarmgrad monitor (0: none)",
    )
    option.group("device, precision and mode")
    option("device", help="auto, cpu, cuda or cuda:N (auto: CUDA when torch sees a GPU)")
    option("precision", choices=PRECISIONS, help="autocast dtype; fp16 scales the loss")
    option(
        "mode", choices=MODES,
        help="sync: average gradients every epoch; local: step locally, average "
        "parameters; diloco: average pseudo-gradients every --inner-steps; streaming: "
        "diloco in --fragments staggered fragments",
    )  # fmt: skip
    option("inner-steps", type=int, help="diloco/streaming: local steps between syncs")
    option("fragments", type=int, help="streaming: fragments synced in turn (default: 4)")
    option("outer-compression", choices=("none", "8bit", "4bit"),
           help="diloco/streaming: codec of the pseudo-gradients (error feedback)")  # fmt: skip
    option("powersgd-rank", type=int, help="sync: average gradients as PowerSGD factors")
    option("grad-compression", choices=COMPRESSIONS, help="sync: codec of the gradients")
    option("offload", action="store_const", const=True,
           help="keep the optimizer's master copy in host memory (sync's default)")  # fmt: skip
    option.current.add_argument(
        "--no-offload", dest="offload", action="store_const", const=False,
        help="keep the optimizer on the model's device",
    )  # fmt: skip
    option("delay", action="store_true",
           help="average and step in the background while the next epoch computes")  # fmt: skip
    option("clip-grad-norm", type=float, help="clip each local step's gradient norm")
    option("grad-accumulation", type=int, help="batches of --batch-size per optimizer step")
    option.group("checkpoints")
    option("checkpoint-dir", help="save to and resume from this directory")
    option("checkpoint-every", type=int, help="epochs between checkpoints")
    option("keep-checkpoints", type=int, help="how many of the newest checkpoints stay")
    add_network_options(option, "peer")
    option.group("output")
    option("progress-json", action="store_true", help="one JSON line per event on stdout")
    option("tensorboard", metavar="DIR", help="write the metrics per epoch for TensorBoard here")
    option("wandb", metavar="PROJECT", help="log the metrics per epoch to this W&B project")
    option("log-level", help="DEBUG, INFO, WARNING, ...")
    parser.set_defaults(run=run, train_parser=parser)


# ---------------------------------------------------------------------- settings


def resolve_settings(args: argparse.Namespace) -> dict[str, Any]:
    """Defaults, then the config file, then the command line; refuses what cannot work."""
    settings, given = layered_settings(args, args.train_parser, DEFAULTS)
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
    settings["_given"] = given
    check_run_options(settings, settings["_given"])
    if settings["role"] == "keeper":
        if not settings["checkpoint_dir"]:
            raise ValueError("--role keeper needs --checkpoint-dir: where it keeps the state")
        if settings["client_mode"]:
            raise ValueError(
                "--role keeper serves the state to joiners, so it must accept connections: "
                "drop --client-mode"
            )
        if settings["keep_every"] <= 0:
            raise ValueError(f"--keep-every must be positive, got {settings['keep_every']}")
    if settings["precision"] == "fp16" and settings["mode"] in ("diloco", "streaming"):
        raise ValueError(
            f"--precision fp16 is not supported with --mode {settings['mode']} (its inner "
            "steps are not loss-scaled); use --precision bf16"
        )
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


_usage_error = partial(usage_error, "train")


def run(args: argparse.Namespace) -> int:
    from swarmgrad.cli.model_module import load_model_module

    try:  # everything checkable before joining the swarm
        settings = resolve_settings(args)
        module = load_model_module(settings["model_module"], settings["module_options"])
    except ValueError as e:  # ModelModuleError and ValidationError are ValueErrors
        return _usage_error(str(e))
    use_swarmgrad_log_handler(str(settings["log_level"]).upper())
    stop = stop_on_signals()
    return Trainer(module, settings, stop).run()


class Trainer:
    """The loop: batches -> loss -> backward -> collaborative step, with checkpoints."""

    def __init__(self, module: Any, settings: dict[str, Any], stop: threading.Event):
        self.module, self.settings, self.stop = module, settings, stop
        self.seed = settings["seed"]
        if self.seed is None:
            self.seed = int.from_bytes(os.urandom(4), "little")
        self.device: Any = None
        self.precision: Any = None
        self.exporters: list[Any] = []

    def say(self, event: str, **fields: Any) -> None:
        if self.settings["progress_json"]:
            print(json.dumps({"event": event, "time": time.time(), **fields}), flush=True)

    def _make_model(self) -> Any:
        """The module's model on ``--device``; refused when split across devices."""
        import torch

        from swarmgrad.cli.train_setup import check_model_device

        s = self.settings
        torch.manual_seed(0)  # every peer builds the same initial weights
        try:
            model = self.module.make_model()
        except Exception as e:
            raise ValueError(
                f"model module {s['model_module']!r}: make_model() failed: {type(e).__name__}: {e}"
            ) from e
        if not isinstance(model, torch.nn.Module):
            raise ValueError(
                f"model module {s['model_module']!r}: make_model() returned "
                f"{type(model).__name__}, not a torch.nn.Module"
            )
        check_model_device(model, f"model module {s['model_module']!r}")
        return model.to(self.device)

    def run(self) -> int:
        try:
            return self._run()
        finally:
            for exporter in self.exporters:
                exporter.close()

    def _run(self) -> int:
        from swarmgrad.cli.model_module import ModelModuleError
        from swarmgrad.cli.train_checkpoint import CheckpointError, load_checkpoint
        from swarmgrad.cli.train_setup import Precision, resolve_device
        from swarmgrad.dht import DHT
        from swarmgrad.monitor.exporters import make_exporters
        from swarmgrad.utils.errors import SwarmgradError

        s = self.settings
        try:
            self.device = resolve_device(s["device"])
            self.exporters = make_exporters(
                s["tensorboard"], s["wandb"], name=f"{s['run_id']}-{os.getpid()}",
                config={k: v for k, v in s.items() if not k.startswith("_")},
            )  # fmt: skip
            self.precision = Precision.create(s["precision"], self.device)
            model = self._make_model()
            checkpoint = load_checkpoint(s["checkpoint_dir"]) if s["checkpoint_dir"] else None
            if checkpoint is not None:
                try:
                    model.load_state_dict(checkpoint["model"])
                except RuntimeError as e:
                    raise ValueError(
                        f"checkpoint {checkpoint['path']!r} does not fit the model of "
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
        except CheckpointError as e:
            print(f"swarmgrad train: {e}", file=sys.stderr, flush=True)
            return EXIT_FAILED
        finally:
            dht.shutdown()

    def _make_optimizer(self, dht: Any, model: Any) -> Any:
        from swarmgrad.cli.train_setup import make_collaborative_optimizer

        return make_collaborative_optimizer(
            self.settings, self.module, dht, model, self._metrics_options()
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
        import torch

        from swarmgrad.cli.train_checkpoint import CheckpointWriter
        from swarmgrad.cli.train_setup import to_device
        from swarmgrad.utils.errors import ValidationError

        s = self.settings
        writer = CheckpointWriter(s["checkpoint_dir"], s["keep_checkpoints"]) if (
            s["checkpoint_dir"]
        ) else None  # fmt: skip
        try:
            opt = self._make_optimizer(dht, model)
        except ValidationError as e:
            return _usage_error(f"the collaborative optimizer refused these options: {e}")
        precision, params = self.precision, [p for p in model.parameters() if p.requires_grad]
        try:
            samples = 0
            if checkpoint is not None:
                opt.load_state_dict(checkpoint["optimizer"])
                samples = int(checkpoint.get("samples", 0))
                logger.info("resumed from %s at epoch %d", checkpoint["path"], opt.local_epoch)
            maddrs = [str(m) for m in dht.get_visible_maddrs()]
            resumed = None if checkpoint is None else opt.local_epoch
            self.say("ready", pid=os.getpid(), maddrs=maddrs, resumed_epoch=resumed,
                     device=str(self.device), mode=s["mode"], precision=s["precision"])  # fmt: skip
            if s["role"] == "keeper":
                assert writer is not None
                return self._keep(opt, model, writer)
            if maddrs and not s["progress_json"]:
                print(f"Training. To join, use --initial-peers {' '.join(maddrs)}", flush=True)
            logger.info("training %s in run %r on %s (%s, --mode %s); this peer: %s",
                        s["model_module"], s["run_id"], self.device, s["precision"], s["mode"],
                        " ".join(maddrs) or "client mode")  # fmt: skip
            last_epoch, saved_epoch = opt.local_epoch, opt.local_epoch
            # On a GPU the loss stays there until an epoch ends (no host sync per step) and
            # the monitor gets the epoch's mean; on the CPU every step's loss is reported.
            loss_sum, loss_count = torch.zeros((), device=self.device), 0
            report_each_step = self.device.type == "cpu"
            window_began, window_samples = time.monotonic(), 0
            accumulation, step_samples = s["grad_accumulation"], 0
            batches = self._batches()
            while not (self.stop.is_set() or self._finished(opt)):
                for _ in range(accumulation):
                    batch = to_device(next(batches), self.device)
                    with precision.autocast():
                        loss = self.module.loss_fn(model, batch)
                    precision.backward(loss / accumulation if accumulation > 1 else loss)
                    loss_sum += loss.detach().float()
                    loss_count += 1
                    if report_each_step:
                        opt.report(float(loss.detach()))
                step_samples = s["batch_size"] * accumulation
                if s["clip_grad_norm"] is not None:
                    precision.clip(params, s["clip_grad_norm"])
                precision.step(opt, step_samples)  # and zero_grad
                samples += step_samples
                window_samples += step_samples
                if opt.local_epoch != last_epoch:
                    last_epoch = opt.local_epoch
                    progress = opt.tracker.global_progress
                    elapsed = max(time.monotonic() - window_began, 1e-9)
                    loss_mean = float(loss_sum) / loss_count if loss_count else None
                    if loss_mean is not None and not report_each_step:
                        opt.report(loss_mean)  # for swarmgrad monitor
                    self.say(
                        "epoch", epoch=last_epoch, global_epoch=progress.epoch,
                        peers=progress.num_peers, loss=loss_mean, samples=samples,
                        samples_per_s=window_samples / elapsed,
                    )  # fmt: skip
                    for exporter in self.exporters:
                        exporter.write(last_epoch, {
                            "train/loss": loss_mean, "train/samples_per_second":
                            window_samples / elapsed, "train/peers": progress.num_peers,
                            "train/global_epoch": progress.epoch, "train/samples": samples,
                        })  # fmt: skip
                    logger.info("epoch %d: loss %.4f, %d peers, %.1f samples/s",
                                last_epoch, loss_mean or float("nan"), progress.num_peers,
                                window_samples / elapsed)  # fmt: skip
                    loss_sum.zero_()
                    loss_count, window_began, window_samples = 0, time.monotonic(), 0
                    if writer and last_epoch - saved_epoch >= s["checkpoint_every"]:
                        writer.save(model, opt, samples=samples)  # written in the background
                        saved_epoch = last_epoch
            if writer:
                writer.save(model, opt, samples=samples)
                path = writer.wait()
                logger.info("saved %s at epoch %d", path, opt.local_epoch)
            self.say("done", epoch=opt.local_epoch, samples=samples)
            return EXIT_OK
        finally:
            if writer:
                writer.wait(raise_error=False)
            opt.shutdown()

    def _keep(self, opt: Any, model: Any, writer: Any) -> int:
        """The keeper: no training; it holds the swarm's state, saves it every
        ``--keep-every`` epochs (checkpoint, plain ``model.pt``, ``save_pretrained`` form)
        and serves it to joiners, so a swarm whose trainers all restart resumes from it.

        In synchronous mode (a :class:`~swarmgrad.optim.StateKeeper`) it takes part in
        every gradient round with weight 0 and applies the average as the trainers do:
        it reaches each epoch in the same round as they do. In the other modes it
        downloads the swarm's state after each epoch (an epoch or two behind)."""
        from swarmgrad.cli.train_checkpoint import export_model
        from swarmgrad.optim import StateKeeper

        s = self.settings
        follows = isinstance(opt, StateKeeper)
        _start_worker_thread()
        kept = opt.local_epoch if writer.last_good is not None else None
        logger.info("keeping the state of run %r every %d epochs in %s (now at epoch %d, %s)",
                    s["run_id"], s["keep_every"], s["checkpoint_dir"], opt.local_epoch,
                    "following its gradient rounds" if follows else
                    "downloading after each epoch")  # fmt: skip
        while not (self.stop.is_set() or self._finished(opt)):
            if follows:
                opt.keep_up()
            else:
                swarm_epoch = opt.tracker.global_epoch
                due = kept is None or swarm_epoch >= kept + s["keep_every"]
                if swarm_epoch > opt.local_epoch and due:
                    opt.load_state_from_peers()
            epoch = opt.local_epoch
            if epoch > 0 and (kept is None or epoch >= kept + s["keep_every"]):
                writer.save(model, opt, background=False)  # (it would wait for it anyway)
                path = writer.wait()
                exported = export_model(s["checkpoint_dir"], model)
                kept = epoch
                logger.info("kept the swarm's state at epoch %d: %s", kept, path)
                self.say("kept", epoch=kept, path=str(path), exports=exported)
            # no need to report anything here: the tracker's keepalive renews this peer's
            # record (joiners find the kept state through its epoch) while it runs; a
            # follower looks often (a look is a few reads), the round's end is news
            self.stop.wait(0.05 if follows else 1.0)
        self.say("done", epoch=opt.local_epoch, samples=0)
        return EXIT_OK

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
                    pin_memory=self.device is not None and self.device.type == "cuda",
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


def _start_worker_thread() -> None:
    """Give the event loop a default executor of one worker thread, started now.

    ``asyncio.to_thread`` work on the loop (freezing a snapshot of the state for a joiner,
    decoding a downloaded state) runs in the loop's default executor, which starts its
    threads at their first use and keeps them. For a keeper that first use is the first
    joiner it serves, maybe hours in, and under concurrent joiners the executor grows a
    thread per overlapping task. A keeper runs for days: it starts the one thread it uses
    with the rest of the peer, so its thread count at start-up is its count for good."""
    import asyncio
    import concurrent.futures

    from swarmgrad.utils.loop_thread import run_coroutine

    executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="swarmgrad-keeper")

    async def install() -> None:
        asyncio.get_running_loop().set_default_executor(executor)
        await asyncio.to_thread(lambda: None)  # its thread starts now

    run_coroutine(install, timeout=30)
