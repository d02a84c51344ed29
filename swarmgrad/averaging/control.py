"""``hivemind.averaging.control``: the handle of a scheduled averaging step.

:class:`StepControl` and :class:`AveragingStage` live in
:mod:`swarmgrad.averaging.step_control`; this module names them at hivemind's path.
"""

from swarmgrad.averaging.step_control import AveragingStage, StepControl

__all__ = ["AveragingStage", "StepControl"]
