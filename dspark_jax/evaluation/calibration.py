"""Sequential Temperature Scaling of the confidence head (spec section 8, paper Sec. 3.2.1).

Each position ``k`` gets a temperature ``T_k > 0`` and a calibrated per-step confidence
``c_k = sigmoid(z_k / T_k)``.  STS fits them left to right on a fitting split: for
``k = 0..P-1`` a 1-D grid search picks the ``T_k`` minimising the ECE of the cumulative
product ``prod_{j <= k} c_j`` against the realised survival, with ``T_0..T_{k-1}`` fixed.
Temperature scaling is monotone, so the ranking of each position's per-step confidences is
unchanged (position 0's AUROC is exactly preserved; later positions' cumulative products mix
several temperatures, so their AUROC can move slightly).

The temperatures live in ``calibration.json`` beside a drafter checkpoint folder::

    {"confidence_temperatures": [T_0, ..., T_{P-1}], "fit": {...}}

where ``fit`` records how they were obtained (see :func:`calibrate`).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from dspark_jax.checkpoints.calibration_file import (CALIBRATION_FILE, Calibration,
                                                   check_temperatures, load_calibration,
                                                   save_calibration)
from dspark_jax.evaluation.metrics import (
    DEFAULT_NUM_BINS,
    _log_sigmoid,
    confidence_metrics,
    expected_calibration_error,
    survival_labels,
)
from dspark_jax.evaluation.trace import AcceptanceTrace, split_by_request

__all__ = [
    "CALIBRATION_FILE",
    "DEFAULT_TEMPERATURE_GRID",
    "Calibration",
    "calibrate",
    "calibration_report",
    "fit_sts",
    "load_calibration",
    "save_calibration",
    "scale_logits",
    "scale_trace",
]

# 401 log-spaced temperatures from 1/20 to 20 (the middle one is 1).
DEFAULT_TEMPERATURE_GRID = np.geomspace(0.05, 20.0, 401)
# A position with fewer surviving rounds than this in the fitting split keeps T = 1: its ECE
# is dominated by a handful of positives, and the grid search then runs to the grid's edge.
DEFAULT_MIN_SURVIVORS = 30


def scale_logits(confidence_logits, temperatures) -> np.ndarray:
    """float32 ``[..., P]``: ``z / T`` (then ``c = sigmoid(z / T)``).

    Args:
      confidence_logits: float ``[..., P]``.
      temperatures: float ``[P]``, finite and positive.
    """
    z = np.asarray(confidence_logits, np.float32)
    if z.ndim == 0:
        raise ValueError("confidence_logits must have a trailing position axis [..., P]")
    t = check_temperatures(temperatures, z.shape[-1])
    return (z / t.astype(np.float32)).astype(np.float32)


def scale_trace(trace: AcceptanceTrace, temperatures) -> AcceptanceTrace:
    """The same trace with calibrated logits ``z / T`` (for any metric of this package)."""
    trace.validate()
    return trace._replace(confidence_logits=scale_logits(trace.confidence_logits, temperatures))


def fit_sts(trace: AcceptanceTrace, grid: Sequence[float] = DEFAULT_TEMPERATURE_GRID,
            num_bins: int = DEFAULT_NUM_BINS,
            min_survivors: int = DEFAULT_MIN_SURVIVORS) -> np.ndarray:
    """Sequential Temperature Scaling on a fitting split.

    For ``k = 0..P-1``: ``T_k = argmin_{T in grid} ECE(prod_{j < k} c_j * sigmoid(z_k / T))``
    with the earlier ``c_j`` already calibrated.  Among equal minima the temperature closest to
    1 (in log scale) wins, so a position without signal keeps its raw confidences; so does a
    position where fewer than ``min_survivors`` rounds survive (too few positives to fit).

    Args:
      trace: ``n`` rounds of ``P`` raw logits (the fitting split; never the evaluation split).
      grid: ``[G]`` candidate temperatures, finite and positive.
      num_bins: ECE bins.
      min_survivors: rounds with ``num_accepted > k`` needed to fit position ``k``.

    Returns:
      float64 ``[P]`` temperatures.
    """
    trace.validate()
    grid = check_temperatures(grid)
    preference = np.argsort(np.abs(np.log(grid)), kind="stable")  # closest to T = 1 first
    z = trace.confidence_logits.astype(np.float64)
    labels = survival_labels(trace)
    prefix = np.zeros(trace.num_rounds)  # log prod_{j < k} c_j
    temperatures = np.empty(trace.block_size)
    for k in range(trace.block_size):
        if labels[:, k].sum() < min_survivors:
            temperatures[k] = 1.0
            prefix = prefix + _log_sigmoid(z[:, k])
            continue
        eces = np.array([
            expected_calibration_error(np.exp(prefix + _log_sigmoid(z[:, k] / t)), labels[:, k],
                                       num_bins)
            for t in grid[preference]])
        temperatures[k] = grid[preference][int(np.argmin(eces))]
        prefix = prefix + _log_sigmoid(z[:, k] / temperatures[k])
    return temperatures


def calibration_report(trace: AcceptanceTrace, temperatures,
                       num_bins: int = DEFAULT_NUM_BINS) -> dict:
    """ECE / AUROC / Brier per position before and after applying ``temperatures``.

    Pass a split NOT used for fitting.

    Returns:
      ``{"before": PositionMetrics.to_dict(), "after": PositionMetrics.to_dict()}``.
    """
    return {"before": confidence_metrics(trace, num_bins).to_dict(),
            "after": confidence_metrics(scale_trace(trace, temperatures), num_bins).to_dict()}


def calibrate(trace: AcceptanceTrace, fit_fraction: float = 0.5, seed: int = 0,
              grid: Sequence[float] = DEFAULT_TEMPERATURE_GRID,
              num_bins: int = DEFAULT_NUM_BINS,
              min_survivors: int = DEFAULT_MIN_SURVIVORS) -> tuple[np.ndarray, dict]:
    """Fits STS on a seeded request split and reports on the other (held-out) part.

    Args:
      trace: the full trace (several requests; see :func:`split_by_request`).
      fit_fraction: share of the requests used for fitting.
      seed: split seed.
      grid, num_bins, min_survivors: as in :func:`fit_sts`.

    Returns:
      (float64 ``[P]`` temperatures, ``fit`` dict for ``calibration.json`` with keys
      ``method, seed, fit_fraction, num_bins, min_survivors, fit_survivors, fit_rounds,
      heldout_rounds, heldout`` where
      ``heldout`` is :func:`calibration_report` on the held-out split).
    """
    fit_part, heldout = split_by_request(trace, fit_fraction, seed)
    temperatures = fit_sts(fit_part, grid, num_bins, min_survivors)
    fit = {"method": "sts", "seed": int(seed), "fit_fraction": float(fit_fraction),
           "num_bins": int(num_bins), "min_survivors": int(min_survivors),
           "fit_survivors": survival_labels(fit_part).sum(axis=0).tolist(),
           "fit_rounds": fit_part.num_rounds,
           "heldout_rounds": heldout.num_rounds,
           "heldout": calibration_report(heldout, temperatures, num_bins)}
    return temperatures, fit
