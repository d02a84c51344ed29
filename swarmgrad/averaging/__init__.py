"""Fault-tolerant averaging: Moshpit matchmaking, butterfly all-reduce, load balancing,
gossip, and state download for joining peers."""

from swarmgrad.averaging import control  # hivemind.averaging.control
from swarmgrad.averaging.allreduce import (
    AllReduceResult,
    AllReduceRunner,
    AveragingMode,
    GroupMismatch,
    UnknownGroup,
)
from swarmgrad.averaging.averager import DecentralizedAverager
from swarmgrad.averaging.averager_core import AsyncDecentralizedAverager
from swarmgrad.averaging.deadlines import AdaptiveTimeouts
from swarmgrad.averaging.gossip import AsyncGossipAverager, GossipAverager, GossipResult
from swarmgrad.averaging.group_info import GroupInfo
from swarmgrad.averaging.key_manager import Declaration, GroupKeyManager
from swarmgrad.averaging.load_balancing import load_balance_peers
from swarmgrad.averaging.matchmaking import Matchmaking
from swarmgrad.averaging.partition import TensorPartContainer, TensorPartReducer
from swarmgrad.averaging.robust import AggregationRule, CenteredClip, TrimmedMean
from swarmgrad.averaging.round_plan import MemberInfo, RoundPlan, plan_round
from swarmgrad.averaging.state_transfer import StateDownloader, StateSharing, load_state_from_peers
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
    "control",
    "load_state_from_peers",
    "plan_round",
]
