"""Import a user's Python file by its path: a model module (``swarmgrad train``), a stage
module (pipelines) or a file of custom expert classes (``--custom-module-path``)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

from swarmgrad.utils.errors import ValidationError

__all__ = ["import_user_file"]


def import_user_file(
    path: str | Path, what: str, prefix: str, error: type[ValidationError] = ValidationError
) -> ModuleType:
    """Execute the Python file at ``path`` as a new module and return it.

    ``what`` names the file in errors (``"model module"``); the module is registered in
    ``sys.modules`` under ``prefix`` and a hash of the resolved path, since dataclasses and
    pickling look modules up by name. A missing file, one that is not Python, and anything
    the file raises while it runs (``SystemExit`` of a script-style file too) become
    ``error``, naming the file and what went wrong.
    """
    file = Path(path)
    where = f"{what} {str(path)!r}"
    if not file.is_file():
        raise error(f"{where} does not exist or is not a file")
    name = f"{prefix}_{abs(hash(str(file.resolve())))}"
    spec = importlib.util.spec_from_file_location(name, file)
    if spec is None or spec.loader is None:
        raise error(f"{where} cannot be imported as Python (is it a .py file?)")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException as e:
        sys.modules.pop(name, None)
        raise error(f"{where} failed to import: {type(e).__name__}: {e}") from e
    return module
