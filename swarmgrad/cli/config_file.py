"""The options of the commands that take many (``server``, ``train``): declared through
one :class:`OptionAdder`, and ``--config FILE``, a JSON, TOML or YAML table whose keys are
the options, spelled either way (``expert-cls`` or ``expert_cls``). The table is turned
back into command-line tokens so that argparse converts and checks its values exactly as
it does the command line's."""

from __future__ import annotations

import argparse
import json
import tomllib
from collections.abc import Collection, Mapping
from pathlib import Path
from typing import Any

from swarmgrad.cli.common import add_command

__all__ = [
    "OptionAdder",
    "add_configurable_command",
    "add_network_options",
    "config_tokens",
    "layered_settings",
    "load_config",
]


class OptionAdder:
    """``option("num-experts", type=int, help=...)`` adds ``--num-experts`` and hivemind's
    spelling ``--num_experts`` (dest ``num_experts``) to the group opened last with
    :meth:`group`, and appends the default from ``defaults`` to the help."""

    def __init__(self, parser: argparse.ArgumentParser, defaults: dict[str, Any]):
        self.parser = parser
        self.defaults = defaults
        self.current: Any = parser  # an ArgumentParser or an argument group

    def group(self, title: str) -> None:
        """Options added from now on are listed under ``title`` in ``--help``."""
        self.current = self.parser.add_argument_group(title)

    def __call__(self, name: str, **kwargs: Any) -> None:
        flags = [f"--{name}"]
        if "-" in name:
            flags.append(f"--{name.replace('-', '_')}")
        dest = name.replace("-", "_")
        if "help" in kwargs and self.defaults.get(dest) not in (None, [], False):
            kwargs["help"] += f" (default: {self.defaults[dest]})"
        self.current.add_argument(*flags, dest=dest, **kwargs)


def add_configurable_command(
    commands: argparse._SubParsersAction,
    name: str,
    *,
    help: str,
    doc: str | None,
    defaults: dict[str, Any],
) -> OptionAdder:
    """The parser of a subcommand whose options ``--config FILE`` may give too, as
    :func:`layered_settings` reads them: it keeps only the options given, the first of
    them ``--config``. The rest are added with the returned adder (``.parser``)."""
    parser = add_command(commands, name, help=help, doc=doc, argument_default=argparse.SUPPRESS)
    option = OptionAdder(parser, defaults)
    option("config", help="JSON, TOML or YAML file with any of these options")
    return option


def add_network_options(option: OptionAdder, who: str) -> None:
    """The ``network and DHT`` group: where to listen and whom to join, the peer's identity
    and admission. ``who`` ("server", "peer") says whose token file ``--access-token`` is."""
    option.group("network and DHT")
    option("initial-peers", nargs="*", help="multiaddrs of peers already in the swarm")
    option("host-maddrs", nargs="+", help="addresses to listen on (tcp/0 picks a port)")
    option("announce-maddrs", nargs="*", help="public addresses to advertise (behind NAT)")
    option("identity-path", help="ed25519 key file (created if missing): a stable PeerID")
    option("authority-key", help="admit only peers with tokens from this authority (12D3KooW...)")
    option("access-token", help=f"this {who}'s token file (swarmgrad authority issue)")


def load_config(path: str) -> dict[str, Any]:
    """Read a JSON, TOML or YAML file of options; keys in either spelling."""
    file = Path(path)
    suffix = file.suffix.lower()
    try:
        text = file.read_text()
        if suffix == ".toml":
            data = tomllib.loads(text)
        elif suffix in (".yaml", ".yml"):
            try:
                import yaml
            except ImportError:
                raise ValueError("YAML configs need PyYAML; use JSON or TOML instead") from None
            data = yaml.safe_load(text)
        else:
            data = json.loads(text)
    except (OSError, ValueError) as e:  # JSON, TOML and YAML errors are ValueErrors
        raise ValueError(f"config file {path!r}: {e}") from e
    if not isinstance(data, dict):
        raise ValueError(f"config file {path!r} must hold a table of options")
    return {str(key).replace("-", "_"): value for key, value in data.items()}


def config_tokens(
    config: dict[str, Any],
    path: str,
    known: Collection[str],
    negative_flags: Mapping[str, str] | None = None,
    flags: Collection[str] | None = None,
) -> list[str]:
    """The config as command-line tokens; options outside ``known`` are refused by name.

    A list becomes one flag followed by its items; a table (e.g. ``module_options``)
    becomes one flag followed by ``KEY=VALUE`` items; ``false`` gives no token, except for
    an option with a flag that turns it off (``negative_flags["use_relay"] = "--no-relay"``).
    ``true`` for an option that has only such a flag (it is on unless turned off; the
    parser's option strings are in ``flags``) gives no token either."""
    negative_flags = negative_flags or {}
    unknown = sorted(set(config) - set(known) - {"config"})
    if unknown:
        raise ValueError(f"config file {path!r}: unknown options {unknown}")
    tokens: list[str] = []
    for key, value in config.items():
        if key == "config" or value is None:
            continue
        flag = "--" + key.replace("_", "-")
        if isinstance(value, bool):
            if value and key in negative_flags and flags is not None and flag not in flags:
                continue  # on by default: nothing to say
            if value:
                tokens.append(flag)
            elif key in negative_flags:
                tokens.append(negative_flags[key])
        elif isinstance(value, dict):
            tokens += [flag, *(f"{k}={v}" for k, v in value.items())]
        elif isinstance(value, list):
            tokens += [flag, *map(str, value)]
        else:
            tokens += [flag, str(value)]
    return tokens


def layered_settings(
    args: argparse.Namespace, parser: argparse.ArgumentParser, defaults: dict[str, Any]
) -> tuple[dict[str, Any], set[str]]:
    """A command's settings, ``defaults`` overridden by the options of ``--config FILE``,
    overridden by those of the command line; and the names of the options set in either.

    ``parser`` keeps only what was given (``argument_default=argparse.SUPPRESS``) and
    ``defaults`` names every option. An option that takes several values, given one
    string, becomes a one-item list."""
    actions = parser._actions  # (argparse has no public list of a parser's options)
    given = {k: v for k, v in vars(args).items() if k in defaults}
    settings = dict(defaults)
    from_file: dict[str, Any] = {}
    if given.get("config"):
        negative_flags = {
            a.dest: a.option_strings[0]
            for a in actions
            if a.option_strings and a.option_strings[0].startswith("--no-")
        }
        flags = {flag for a in actions for flag in a.option_strings}
        tokens = config_tokens(
            load_config(given["config"]), given["config"], defaults, negative_flags, flags
        )
        from_file = {k: v for k, v in vars(parser.parse_args(tokens)).items() if k in defaults}
    settings.update(from_file)
    settings.update(given)
    for key in {a.dest for a in actions if a.nargs in ("*", "+")}:
        if isinstance(settings[key], str):
            settings[key] = [settings[key]]
    return settings, set(given) | set(from_file)
