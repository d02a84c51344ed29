"""The group all-reduce: its plan (spans, load balancing, parts), the runner that streams
a round, and what feeds it (buffers, deadlines, send pacing).

* :mod:`.types` — modes, results and errors shared with planners and accountants
* :mod:`.protocol` — the wire protocol (``averaging.aggregate_part``)
* :mod:`.round_plan`, :mod:`.partition`, :mod:`.load_balancing` — who reduces what
* :mod:`.runner` — one round (:class:`AllReduceRunner`); :mod:`.router` serves its streams
* :mod:`.buffers`, :mod:`.deadlines`, :mod:`.pacing`, :mod:`.streams` — its helpers
"""

from swarmgrad.averaging.allreduce.protocol import AGGREGATE_PART, PROTOCOL_VERSION
from swarmgrad.averaging.allreduce.router import AllReduceRouter
from swarmgrad.averaging.allreduce.runner import AllReduceRunner
from swarmgrad.averaging.allreduce.types import (
    MAX_WEIGHT,
    AllReduceResult,
    AveragingMode,
    BadReduction,
    GroupMismatch,
    UnknownGroup,
)

__all__ = [
    "AGGREGATE_PART",
    "MAX_WEIGHT",
    "PROTOCOL_VERSION",
    "AllReduceResult",
    "AllReduceRouter",
    "AllReduceRunner",
    "AveragingMode",
    "BadReduction",
    "GroupMismatch",
    "UnknownGroup",
]
