"""Collaborative training: progress tracking, gradient and state averagers, the
``Optimizer`` that trains one model across the swarm (DeDLOC), and ``DiLoCoOptimizer``
for slow links (DiLoCo, Streaming DiLoCo), PowerSGD, and sites of ``torch.distributed``
ranks that take part as one peer."""

from swarmgrad.optim.diloco import DiLoCoOptimizer
from swarmgrad.optim.grad_averager import GradientAverager, GradientAveragerFactory
from swarmgrad.optim.grad_scaler import GradScaler
from swarmgrad.optim.keeper import StateKeeper
from swarmgrad.optim.metrics import MetricsPublisher, MetricsSchema, PeerMetrics
from swarmgrad.optim.optimizer import Optimizer
from swarmgrad.optim.performance_ema import PerformanceEMA
from swarmgrad.optim.power_sgd_averager import PowerSGDGradientAverager
from swarmgrad.optim.progress import (
    GlobalTrainingProgress,
    LocalTrainingProgress,
    TrainingProgressSchema,
    aggregate_progress,
)
from swarmgrad.optim.progress_tracker import ProgressTracker
from swarmgrad.optim.site import SiteError, SiteMismatch, SiteOptimizer
from swarmgrad.optim.state_averager import TrainingStateAverager
from swarmgrad.optim.training_averager import TrainingAverager

__all__ = [
    "DiLoCoOptimizer",
    "GlobalTrainingProgress",
    "GradScaler",
    "GradientAverager",
    "GradientAveragerFactory",
    "LocalTrainingProgress",
    "MetricsPublisher",
    "MetricsSchema",
    "Optimizer",
    "PeerMetrics",
    "PerformanceEMA",
    "PowerSGDGradientAverager",
    "ProgressTracker",
    "SiteError",
    "SiteMismatch",
    "SiteOptimizer",
    "StateKeeper",
    "TrainingProgressSchema",
    "TrainingAverager",
    "TrainingStateAverager",
    "aggregate_progress",
]
