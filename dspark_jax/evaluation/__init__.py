"""Offline evaluation of the confidence head: traces, metrics, STS calibration, figures.

``dspark_jax.evaluation.figures`` (matplotlib) is imported on demand, not from here.
"""

from dspark_jax.evaluation.calibration import (
    CALIBRATION_FILE,
    Calibration,
    calibrate,
    calibration_report,
    fit_sts,
    load_calibration,
    save_calibration,
    scale_logits,
    scale_trace,
)
from dspark_jax.evaluation.metrics import (
    PositionMetrics,
    ReliabilityBins,
    ThresholdSweep,
    accept_rate_at_k,
    auroc,
    brier_score,
    conditional_acceptance,
    confidence_metrics,
    cumulative_survival,
    expected_calibration_error,
    per_step_confidence,
    reliability_bins,
    survival_labels,
    threshold_sweep,
)
from dspark_jax.evaluation.trace import (
    AcceptanceTrace,
    concatenate_traces,
    split_by_request,
)

__all__ = [
    "CALIBRATION_FILE",
    "AcceptanceTrace",
    "Calibration",
    "PositionMetrics",
    "ReliabilityBins",
    "ThresholdSweep",
    "accept_rate_at_k",
    "auroc",
    "brier_score",
    "calibrate",
    "calibration_report",
    "concatenate_traces",
    "conditional_acceptance",
    "confidence_metrics",
    "cumulative_survival",
    "expected_calibration_error",
    "fit_sts",
    "load_calibration",
    "per_step_confidence",
    "reliability_bins",
    "save_calibration",
    "scale_logits",
    "scale_trace",
    "split_by_request",
    "survival_labels",
    "threshold_sweep",
]
