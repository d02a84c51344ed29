"""Robust aggregation: rules (CenteredClip, trimmed mean), the owner's reducer with its
checks, and the log of offenders and bans."""

from swarmgrad.averaging.robust.rules import AggregationRule, CenteredClip, TrimmedMean

__all__ = ["AggregationRule", "CenteredClip", "TrimmedMean"]
