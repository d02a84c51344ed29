"""``--config FILE`` of the commands that take many options (``server``, ``train``): a
JSON, TOML or YAML table whose keys are the options, spelled either way
(``expert-cls`` or ``expert_cls``). The table is turned back into command-line tokens so
that argparse converts and checks its values exactly as it does the command line's."""

from __future__ import annotations

import json
import tomllib
from collections.abc import Collection
from pathlib import Path
from typing import Any

__all__ = ["config_tokens", "load_config"]


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


def config_tokens(config: dict[str, Any], path: str, known: Collection[str]) -> list[str]:
    """The config as command-line tokens; options outside ``known`` are refused by name.

    A list becomes one flag followed by its items; a table (e.g. ``module_options``)
    becomes one flag followed by ``KEY=VALUE`` items."""
    unknown = sorted(set(config) - set(known) - {"config"})
    if unknown:
        raise ValueError(f"config file {path!r}: unknown options {unknown}")
    tokens: list[str] = []
    for key, value in config.items():
        if key == "config" or value is None:
            continue
        flag = "--" + key.replace("_", "-")
        if isinstance(value, bool):
            if value:
                tokens.append(flag)
        elif isinstance(value, dict):
            tokens += [flag, *(f"{k}={v}" for k, v in value.items())]
        elif isinstance(value, list):
            tokens += [flag, *map(str, value)]
        else:
            tokens += [flag, str(value)]
    return tokens
