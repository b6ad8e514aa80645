"""Offline confidence metrics of an :class:`AcceptanceTrace` (spec sections 7 and 8).

Shapes: ``n`` rounds, ``P`` proposals per round, ``m`` thresholds, ``B`` calibration bins.

* Cumulative survival estimate of position ``k`` (0-based): ``prod_{j <= k} sigmoid(z_j)``
  (apply STS temperatures first with :func:`dspark_jax.evaluation.calibration.scale_trace`).
* Realised survival label: ``num_accepted > k``.
* Per position: ECE with ``B = 20`` equal-width bins (``idx = floor(p * B)`` clamped,
  ``ECE = sum_b n_b |mean_pred_b - mean_label_b| / N``), AUROC (Mann-Whitney statistic, a tie
  between a positive and a negative counts 1/2), Brier score (mean squared error).
* Acceptance per position: ``accept_rate@k = P(accepted > k)`` and the paper's Figure 2
  conditional acceptance ``P(accepted > k | accepted >= k)``.
* Static threshold sweep (paper Figure 5) with the engine's own truncation rule,
  :func:`dspark_jax.scheduling.threshold_proposal_len`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import jax
import numpy as np

from dspark_jax.evaluation.trace import AcceptanceTrace
from dspark_jax.scheduling import threshold_proposal_len

__all__ = [
    "DEFAULT_NUM_BINS",
    "DEFAULT_THRESHOLDS",
    "PositionMetrics",
    "ReliabilityBins",
    "ThresholdSweep",
    "accept_rate_at_k",
    "auroc",
    "brier_score",
    "conditional_acceptance",
    "confidence_metrics",
    "cumulative_survival",
    "expected_calibration_error",
    "per_step_confidence",
    "reliability_bins",
    "survival_labels",
    "threshold_sweep",
]

DEFAULT_NUM_BINS = 20
DEFAULT_THRESHOLDS = (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)


# ----------------------------------------------------------------------------- estimates


def _log_sigmoid(x: np.ndarray) -> np.ndarray:
    """Stable ``log(sigmoid(x))`` in float64."""
    return -np.logaddexp(0.0, -np.asarray(x, np.float64))


def per_step_confidence(trace: AcceptanceTrace) -> np.ndarray:
    """float64 ``[n, P]``: ``c_k = sigmoid(z_k)``."""
    return np.exp(_log_sigmoid(trace.validate().confidence_logits))


def cumulative_survival(trace: AcceptanceTrace) -> np.ndarray:
    """float64 ``[n, P]``: ``prod_{j <= k} sigmoid(z_j)``, summed in log space."""
    return np.exp(np.cumsum(_log_sigmoid(trace.validate().confidence_logits), axis=-1))


def survival_labels(trace: AcceptanceTrace) -> np.ndarray:
    """bool ``[n, P]``: ``num_accepted > k``."""
    trace.validate()
    return trace.num_accepted[:, None] > np.arange(trace.block_size)[None, :]


# ----------------------------------------------------------------------------- scores


def _check_scores(probs, labels) -> tuple[np.ndarray, np.ndarray]:
    """float64 ``[N]`` probabilities in [0, 1] and float64 ``[N]`` 0/1 labels."""
    p = np.asarray(probs, np.float64)
    y = np.asarray(labels)
    if p.ndim != 1 or y.shape != p.shape:
        raise ValueError(f"probs and labels must be 1-D of the same length, got shapes "
                         f"{p.shape} and {y.shape}")
    if p.size == 0:
        raise ValueError("no samples to score")
    if not np.all((p >= 0.0) & (p <= 1.0)):
        raise ValueError("probs must lie in [0, 1] (NaN is not allowed)")
    if not np.all((y == 0) | (y == 1)):
        raise ValueError("labels must be 0/1 (or bool)")
    return p, y.astype(np.float64)


class ReliabilityBins(NamedTuple):
    """Equal-width bins of a reliability diagram (``B`` bins over [0, 1]).

    ``mean_prediction`` and ``mean_label`` are NaN in empty bins.
    """

    counts: np.ndarray  # int64 [B]
    mean_prediction: np.ndarray  # float64 [B]
    mean_label: np.ndarray  # float64 [B]


def reliability_bins(probs, labels, num_bins: int = DEFAULT_NUM_BINS) -> ReliabilityBins:
    """Bins samples by ``idx = clip(floor(p * B), 0, B - 1)``.

    Args:
      probs: float ``[N]`` predicted probabilities in [0, 1].
      labels: 0/1 ``[N]`` outcomes.
      num_bins: ``B``.
    """
    p, y = _check_scores(probs, labels)
    if num_bins < 1:
        raise ValueError(f"num_bins must be >= 1, got {num_bins}")
    idx = np.clip(np.floor(p * num_bins).astype(np.int64), 0, num_bins - 1)
    counts = np.bincount(idx, minlength=num_bins)
    with np.errstate(invalid="ignore", divide="ignore"):
        mean_pred = np.bincount(idx, weights=p, minlength=num_bins) / counts
        mean_label = np.bincount(idx, weights=y, minlength=num_bins) / counts
    return ReliabilityBins(counts, mean_pred, mean_label)


def expected_calibration_error(probs, labels, num_bins: int = DEFAULT_NUM_BINS) -> float:
    """``sum_b n_b |mean_pred_b - mean_label_b| / N`` over equal-width bins.

    Args:
      probs: float ``[N]`` in [0, 1].
      labels: 0/1 ``[N]``.
      num_bins: ``B``.
    """
    bins = reliability_bins(probs, labels, num_bins)
    filled = bins.counts > 0
    gaps = np.abs(bins.mean_prediction[filled] - bins.mean_label[filled])
    return float(np.sum(bins.counts[filled] * gaps) / np.sum(bins.counts))


def _midranks(x: np.ndarray) -> np.ndarray:
    """float64 ``[N]`` 1-based ranks of ``x``, tied values sharing their mean rank."""
    order = np.argsort(x, kind="stable")
    xs = x[order]
    starts = np.concatenate([[0], np.flatnonzero(np.diff(xs)) + 1])
    ends = np.concatenate([starts[1:], [x.size]])
    ranks = np.empty(x.size, np.float64)
    ranks[order] = np.repeat((starts + ends + 1) / 2.0, ends - starts)
    return ranks


def auroc(scores, labels) -> float:
    """Area under the ROC curve as the Mann-Whitney statistic.

    ``AUROC = (sum of the positives' mid-ranks - n_pos (n_pos + 1) / 2) / (n_pos n_neg)``,
    i.e. the fraction of (positive, negative) pairs where the positive scores higher, a tie
    counting 1/2.

    Args:
      scores: float ``[N]`` in [0, 1].
      labels: 0/1 ``[N]``.

    Returns:
      NaN when only one class is present.
    """
    s, y = _check_scores(scores, labels)
    positive = y == 1
    n_pos = int(positive.sum())
    n_neg = s.size - n_pos
    if n_pos == 0 or n_neg == 0:
        return float("nan")
    rank_sum = float(_midranks(s)[positive].sum())
    return (rank_sum - n_pos * (n_pos + 1) / 2.0) / (n_pos * n_neg)


def brier_score(probs, labels) -> float:
    """``mean((p - y)^2)`` over ``[N]`` samples."""
    p, y = _check_scores(probs, labels)
    return float(np.mean((p - y) ** 2))


# ----------------------------------------------------------------------------- per position


def _nan_to_none(values) -> list:
    return [None if np.isnan(v) else float(v) for v in np.asarray(values, np.float64)]


def _nanmean(values) -> float | None:
    values = np.asarray(values, np.float64)
    return None if np.all(np.isnan(values)) else float(np.nanmean(values))


class PositionMetrics(NamedTuple):
    """Calibration metrics of the cumulative survival, one entry per block position.

    ``auroc`` is NaN at positions where every round survived or none did.
    """

    ece: np.ndarray  # float64 [P]
    auroc: np.ndarray  # float64 [P]
    brier: np.ndarray  # float64 [P]
    mean_prediction: np.ndarray  # float64 [P] mean cumulative survival estimate
    survival_rate: np.ndarray  # float64 [P] realised fraction of rounds with accepted > k
    num_rounds: int

    def to_dict(self) -> dict:
        """JSON-ready dict: per-position lists (NaN -> None) plus their means over positions."""
        out = {"num_rounds": int(self.num_rounds)}
        for name in ("ece", "auroc", "brier", "mean_prediction", "survival_rate"):
            out[name] = _nan_to_none(getattr(self, name))
        for name in ("ece", "auroc", "brier"):
            out[f"{name}_mean"] = _nanmean(getattr(self, name))
        return out


def confidence_metrics(trace: AcceptanceTrace,
                       num_bins: int = DEFAULT_NUM_BINS) -> PositionMetrics:
    """ECE, AUROC and Brier of the cumulative survival against realised survival, per position.

    Args:
      trace: ``n`` rounds of ``P`` positions (temperatures, if any, already applied).
      num_bins: ECE bins.
    """
    probs = cumulative_survival(trace)
    labels = survival_labels(trace)
    cols = range(trace.block_size)
    return PositionMetrics(
        ece=np.array([expected_calibration_error(probs[:, k], labels[:, k], num_bins)
                      for k in cols]),
        auroc=np.array([auroc(probs[:, k], labels[:, k]) for k in cols]),
        brier=np.array([brier_score(probs[:, k], labels[:, k]) for k in cols]),
        mean_prediction=probs.mean(axis=0),
        survival_rate=labels.mean(axis=0),
        num_rounds=trace.num_rounds,
    )


def accept_rate_at_k(trace: AcceptanceTrace) -> np.ndarray:
    """float64 ``[P]``: fraction of rounds with ``num_accepted > k`` (each round proposes P)."""
    return survival_labels(trace).mean(axis=0)


def conditional_acceptance(trace: AcceptanceTrace) -> np.ndarray:
    """float64 ``[P]``: ``#(accepted > k) / #(accepted >= k)``; NaN where no round reached ``k``.

    The paper's Figure 2 "conditional acceptance at position k": the acceptance rate among
    rounds whose first ``k`` drafts all survived.
    """
    trace.validate()
    k = np.arange(trace.block_size)
    reached = np.sum(trace.num_accepted[:, None] >= k[None, :], axis=0)
    survived = np.sum(trace.num_accepted[:, None] > k[None, :], axis=0)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(reached > 0, survived / reached, np.nan)


# ----------------------------------------------------------------------------- threshold sweep


class ThresholdSweep(NamedTuple):
    """Verified draft tokens under a static confidence threshold, summed over rounds."""

    thresholds: np.ndarray  # float64 [m]
    accepted: np.ndarray  # int64 [m] sum of min(num_accepted, length)
    rejected: np.ndarray  # int64 [m] sum of length - min(num_accepted, length)
    num_rounds: int

    @property
    def verified(self) -> np.ndarray:
        """int64 ``[m]``: total verification length, ``accepted + rejected``."""
        return self.accepted + self.rejected

    @property
    def acceptance(self) -> np.ndarray:
        """float64 ``[m]``: ``accepted / verified``, NaN where nothing was verified."""
        with np.errstate(invalid="ignore", divide="ignore"):
            return np.where(self.verified > 0, self.accepted / self.verified, np.nan)

    def to_dict(self) -> dict:
        """JSON-ready dict (NaN -> None)."""
        return {"thresholds": [float(t) for t in self.thresholds],
                "accepted": [int(v) for v in self.accepted],
                "rejected": [int(v) for v in self.rejected],
                "verified": [int(v) for v in self.verified],
                "acceptance": _nan_to_none(self.acceptance),
                "num_rounds": int(self.num_rounds)}


def threshold_sweep(trace: AcceptanceTrace,
                    thresholds: Sequence[float] = DEFAULT_THRESHOLDS) -> ThresholdSweep:
    """What a static threshold on the per-step confidence would have verified (paper Fig. 5).

    For each threshold ``t`` every round verifies ``length = threshold_proposal_len(c, t)`` drafts
    (the prefix before the first ``c_k < t``; the whole block when ``t <= 0``), computed by the
    engine's own policy on ``c = jax.nn.sigmoid(z)`` in float32; of those,
    ``min(num_accepted, length)`` are accepted and the rest rejected.  Valid because the trace
    was recorded with the full block verified, so ``num_accepted`` is known for every prefix.

    Args:
      trace: ``n`` rounds (temperatures, if any, already applied).
      thresholds: ``[m]`` thresholds.
    """
    t = np.asarray(thresholds, np.float32)
    if t.ndim != 1 or t.size == 0:
        raise ValueError(f"thresholds must be a non-empty 1-D sequence, got shape {t.shape}")
    confidences = jax.nn.sigmoid(trace.validate().confidence_logits)  # float32, as the engine
    lengths = np.asarray(jax.vmap(threshold_proposal_len, in_axes=(None, 0))(confidences, t))
    accepted = np.minimum(trace.num_accepted[None, :], lengths).astype(np.int64)
    return ThresholdSweep(thresholds=np.asarray(thresholds, np.float64),
                          accepted=accepted.sum(axis=1),
                          rejected=(lengths - accepted).sum(axis=1).astype(np.int64),
                          num_rounds=trace.num_rounds)
