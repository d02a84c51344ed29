"""The options of ``swarmgrad train`` that must agree with each other, and their check.

Kept apart from ``train_setup`` (devices, precision, the optimizer) because the command's
parser needs them and importing torch for that would cost every ``swarmgrad`` command,
the bootstrap peer's ``swarmgrad dht`` included, 1.7 s and 130 MB.
"""

from __future__ import annotations

from typing import Any

from swarmgrad.utils.checks import one_of, positive_int, positive_number
from swarmgrad.utils.errors import ValidationError

__all__ = ["COMPRESSIONS", "MODES", "PRECISIONS", "check_run_options"]

MODES = ("sync", "local", "diloco", "streaming")
PRECISIONS = ("fp32", "bf16", "fp16")
#: codecs by option value: gradients (--grad-compression) and outer gradients
#: (--outer-compression) take the same names
COMPRESSIONS = ("none", "fp16", "bf16", "8bit", "4bit")
_DILOCO_ONLY = ("inner_steps", "fragments", "outer_compression")
_GRADIENT_ONLY = ("powersgd_rank", "grad_compression", "offload", "delay")
_NOT_DEFAULT = {"outer_compression": "none", "grad_compression": "none"}


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def check_run_options(settings: dict[str, Any], given: set[str]) -> None:
    """Refuse options that cannot work together (``given``: the options the user set)."""
    s = settings
    one_of("--mode", s["mode"], MODES)
    one_of("--precision", s["precision"], PRECISIONS)
    one_of("--grad-compression", s["grad_compression"], COMPRESSIONS)
    one_of("--outer-compression", s["outer_compression"], ("none", "8bit", "4bit"))
    if s["use_local_updates"]:
        if s["mode"] not in ("sync", "local"):
            raise ValidationError(
                f"--use-local-updates is --mode local; it contradicts --mode {s['mode']}"
            )
        s["mode"] = "local"
    positive_int("--inner-steps", s["inner_steps"])
    positive_int("--grad-accumulation", s["grad_accumulation"])
    positive_int("--keep-checkpoints", s["keep_checkpoints"])
    if s["clip_grad_norm"] is not None:
        positive_number("--clip-grad-norm", s["clip_grad_norm"])
    if s["powersgd_rank"] is not None:
        positive_int("--powersgd-rank", s["powersgd_rank"])
    diloco = s["mode"] in ("diloco", "streaming")

    def set_here(name: str) -> bool:
        value = s[name]
        return name in given and value not in (None, False, _NOT_DEFAULT.get(name))

    for name in _DILOCO_ONLY:
        if not diloco and set_here(name):
            raise ValidationError(
                f"{_flag(name)} applies to --mode diloco or streaming, not --mode {s['mode']}"
            )
    for name in _GRADIENT_ONLY:
        if diloco and set_here(name):
            raise ValidationError(
                f"{_flag(name)} has no meaning with --mode {s['mode']} (it averages "
                "pseudo-gradients, see --outer-compression); use --mode sync or local"
            )
    for name in ("powersgd_rank", "grad_compression"):
        if s["mode"] == "local" and set_here(name):
            raise ValidationError(
                f"{_flag(name)} compresses averaged gradients: --mode local averages "
                "parameters instead; use --mode sync"
            )
    if s["delay"]:
        if s["offload"] is False:
            raise ValidationError(
                "--delay steps in the background on the offloaded master copy: it cannot "
                "go with --no-offload"
            )
        s["offload"] = True
    if s["mode"] == "streaming":
        s["fragments"] = 4 if s["fragments"] is None else s["fragments"]
        if positive_int("--fragments", s["fragments"]) < 2:
            raise ValidationError(
                f"--mode streaming needs --fragments of 2 or more, got {s['fragments']}"
            )
    elif s["mode"] == "diloco":
        s["fragments"] = 1 if s["fragments"] is None else s["fragments"]
        if positive_int("--fragments", s["fragments"]) != 1:
            raise ValidationError(
                f"--fragments {s['fragments']} means streaming: use --mode streaming"
            )
