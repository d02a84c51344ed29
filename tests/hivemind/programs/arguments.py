"""Command-line arguments of the ALBERT programs, grouped as in hivemind's example (the
same option names, so the same command lines work), parsed with argparse so the programs
run with or without `transformers`."""

from __future__ import annotations

import argparse
import dataclasses
import typing
from dataclasses import dataclass, field


@dataclass
class BaseTrainingArguments:
    run_id: str = "albert"  # the experiment's name: the prefix of its DHT keys
    initial_peers: list[str] = field(default_factory=list)  # multiaddrs to join through
    use_ipfs: bool = False  # libp2p-only in hivemind; swarmgrad warns and ignores it
    host_maddrs: list[str] = field(default_factory=lambda: ["/ip4/0.0.0.0/tcp/0"])
    announce_maddrs: list[str] = field(default_factory=list)
    identity_path: str | None = None  # a stable identity (the PeerID stays the same)


@dataclass
class AveragerArguments:
    target_group_size: int = 256


@dataclass
class ProgressTrackerArguments:
    min_refresh_period: float = 0.5
    max_refresh_period: float = 30
    default_refresh_period: float = 3
    expected_drift_peers: float = 3
    expected_drift_rate: float = 0.2
    metadata_expiration: float = 120


@dataclass
class OptimizerArguments:
    target_batch_size: int = 4096
    client_mode: bool = False
    batch_size_lead: int = 0
    bandwidth: float = 100.0
    averaging_timeout: float = 60.0
    matchmaking_time: float = 5.0


@dataclass
class CollaborationArguments(OptimizerArguments, BaseTrainingArguments):
    statistics_expiration: float = 600
    backup_every_steps: int = 10


@dataclass
class DatasetArguments:
    dataset_path: str = "data/tokenized.json"
    tokenizer_path: str = "data/tokenizer"
    config_path: str = "data/config"
    cache_dir: str = "data"


@dataclass
class AlbertTrainingArguments:
    """What the training loop needs of transformers' TrainingArguments, same names."""

    per_device_train_batch_size: int = 4
    gradient_accumulation_steps: int = 2
    total_steps: int = 125_000  # only shapes the learning rate schedule
    learning_rate: float = 0.00176
    warmup_steps: int = 5000
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_epsilon: float = 1e-6
    weight_decay: float = 0.01
    max_grad_norm: float = 1.0
    seed: int = 42
    output_dir: str = "outputs"
    max_steps: int = 10**30  # "compute gradients forever", as in hivemind's example


def _parse_bool(text: str) -> bool:
    if text.lower() in ("1", "true", "yes"):
        return True
    if text.lower() in ("0", "false", "no"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def parse_args_into_dataclasses(*classes: type, args: list[str] | None = None) -> tuple:
    """transformers.HfArgumentParser's parse_args_into_dataclasses, for these classes."""
    parser = argparse.ArgumentParser()
    owners: dict[str, type] = {}
    for cls in classes:
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if f.name in owners:
                continue
            owners[f.name] = cls
            hint = hints[f.name]
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            if hint is bool:
                parser.add_argument(
                    f"--{f.name}", type=_parse_bool, nargs="?", const=True, default=default
                )
            elif typing.get_origin(hint) is list:
                parser.add_argument(f"--{f.name}", nargs="*", default=default)
            else:
                kind = next((t for t in typing.get_args(hint) if t is not type(None)), hint)
                parser.add_argument(f"--{f.name}", type=kind, default=default)
    namespace = vars(parser.parse_args(args))
    return tuple(
        cls(**{f.name: namespace[f.name] for f in dataclasses.fields(cls)}) for cls in classes
    )
