"""Fault-tolerant averaging: Moshpit matchmaking, butterfly all-reduce, load balancing,
gossip, and state download for joining peers.

Where things are:

* :mod:`.averager` — :class:`DecentralizedAverager`, the public facade (hivemind's
  signature); :mod:`.averager_core` its engine on the event loop, :mod:`.rounds` what a
  custom ``aggregate`` hook gets, :mod:`.options` the options, validated once.
* :mod:`.matchmaking` — ``protocol`` (``averaging.join_group``), ``rules`` (who leads,
  who follows, when a group begins; no I/O), ``group_bits`` and ``key_manager`` (group
  keys in the DHT), ``driver`` (:class:`Matchmaking`, the I/O).
* :mod:`.allreduce` — ``protocol`` (``averaging.aggregate_part``), ``types`` (modes,
  results, errors), ``round_plan``/``partition``/``load_balancing`` (who reduces what),
  ``runner`` and ``owner`` (one round), ``router``, ``buffers``, ``deadlines``, ``pacing``.
* :mod:`.robust` — ``rules`` (CenteredClip, trimmed mean), ``reducer``, ``offenders``.
* :mod:`.state` — ``protocol`` (declarations and the donor RPCs), ``chunks``,
  ``scheduler``, ``sharing``, ``download``.
* :mod:`.gossip` — ``protocol``, ``rules`` (dpwa mixing), ``averager``.
"""

from swarmgrad.averaging import control  # hivemind.averaging.control
from swarmgrad.averaging.allreduce.deadlines import AdaptiveTimeouts
from swarmgrad.averaging.allreduce.load_balancing import load_balance_peers
from swarmgrad.averaging.allreduce.partition import TensorPartContainer, TensorPartReducer
from swarmgrad.averaging.allreduce.round_plan import MemberInfo, RoundPlan, plan_round
from swarmgrad.averaging.allreduce.runner import AllReduceRunner
from swarmgrad.averaging.allreduce.types import (
    AllReduceResult,
    AveragingMode,
    GroupMismatch,
    UnknownGroup,
)
from swarmgrad.averaging.averager import DecentralizedAverager
from swarmgrad.averaging.averager_core import AsyncDecentralizedAverager
from swarmgrad.averaging.gossip.averager import AsyncGossipAverager, GossipAverager, GossipResult
from swarmgrad.averaging.group_info import GroupInfo
from swarmgrad.averaging.matchmaking.driver import Matchmaking
from swarmgrad.averaging.matchmaking.key_manager import Declaration, GroupKeyManager
from swarmgrad.averaging.robust.rules import AggregationRule, CenteredClip, TrimmedMean
from swarmgrad.averaging.state.transfer import StateDownloader, StateSharing, load_state_from_peers
from swarmgrad.averaging.step_control import AveragingStage, StepControl

__all__ = [
    "control",
    "AdaptiveTimeouts",
    "AggregationRule",
    "CenteredClip",
    "TrimmedMean",
    "AllReduceResult",
    "AllReduceRunner",
    "AsyncDecentralizedAverager",
    "AsyncGossipAverager",
    "AveragingMode",
    "AveragingStage",
    "Declaration",
    "DecentralizedAverager",
    "GossipAverager",
    "GossipResult",
    "GroupInfo",
    "GroupKeyManager",
    "GroupMismatch",
    "Matchmaking",
    "MemberInfo",
    "RoundPlan",
    "StateDownloader",
    "StateSharing",
    "StepControl",
    "TensorPartContainer",
    "TensorPartReducer",
    "UnknownGroup",
    "load_balance_peers",
    "load_state_from_peers",
    "plan_round",
]
