"""Fault-tolerant averaging: Moshpit matchmaking, butterfly all-reduce, load balancing,
gossip, and state download for joining peers."""

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
