"""Tests for dspark_jax.evaluation.metrics (spec sections 7 and 8) on a hand-computed trace."""

from __future__ import annotations

import numpy as np
import pytest

from dspark_jax.evaluation import (
    AcceptanceTrace,
    accept_rate_at_k,
    auroc,
    brier_score,
    conditional_acceptance,
    confidence_metrics,
    cumulative_survival,
    expected_calibration_error,
    threshold_sweep,
)
from dspark_jax.scheduling import threshold_proposal_len

# Six rounds of a P = 2 block.  Per-step confidences c (logits are logit(c)) and accepted counts:
#   round  c0    c1   cumulative (c0, c0*c1)  accepted  labels
#   r0     0.82  0.6  (0.82, 0.492)           2         (1, 1)
#   r1     0.52  0.6  (0.52, 0.312)           1         (1, 0)
#   r2     0.52  0.5  (0.52, 0.26)            0         (0, 0)
#   r3     0.27  0.9  (0.27, 0.243)           0         (0, 0)
#   r4     0.52  0.6  (0.52, 0.312)           2         (1, 1)
#   r5     0.53  0.9  (0.53, 0.477)           1         (1, 0)
C = np.array([[0.82, 0.6], [0.52, 0.6], [0.52, 0.5], [0.27, 0.9], [0.52, 0.6], [0.53, 0.9]])
ACCEPTED = np.array([2, 1, 0, 0, 2, 1])


def crafted_trace() -> AcceptanceTrace:
    return AcceptanceTrace.create(np.log(C / (1 - C)), ACCEPTED)


def test_cumulative_survival_and_labels():
    trace = crafted_trace()
    expected = np.array([[0.82, 0.492], [0.52, 0.312], [0.52, 0.26], [0.27, 0.243],
                         [0.52, 0.312], [0.53, 0.477]])
    np.testing.assert_allclose(cumulative_survival(trace), expected, atol=1e-6)


def test_position_0_by_hand():
    # probs .82 .52 .52 .27 .52 .53, labels 1 1 0 0 1 1.
    # ECE (20 bins of width .05): bin 16 {.82|1}: .18; bin 5 {.27|0}: .27;
    #   bin 10 {.52|1, .52|0, .52|1, .53|1}: 4 * |2.09/4 - 3/4| = .91;  (.18 + .27 + .91) / 6.
    # Brier: (.18^2 + .48^2 + .52^2 + .27^2 + .48^2 + .47^2) / 6 = 1.0574 / 6.
    # AUROC: positives .82 .52 .52 .53 vs negatives .52 .27:
    #   .82 -> 2, each .52 -> 0.5 (tie) + 1, .53 -> 2;  total 7 of 8 pairs.
    metrics = confidence_metrics(crafted_trace())
    assert metrics.ece[0] == pytest.approx(1.36 / 6, abs=1e-6)
    assert metrics.brier[0] == pytest.approx(1.0574 / 6, abs=1e-6)
    assert metrics.auroc[0] == pytest.approx(7 / 8)


def test_position_1_by_hand():
    # probs .492 .312 .26 .243 .312 .477, labels 1 0 0 0 1 0.
    # ECE: bin 9 {.492|1, .477|0}: 2 * |.4845 - .5| = .031; bin 6 {.312|0, .312|1}:
    #   2 * |.312 - .5| = .376; bin 5 {.26|0}: .26; bin 4 {.243|0}: .243;  total .91 / 6.
    # Brier: (.508^2 + .312^2 + .26^2 + .243^2 + .688^2 + .477^2) / 6 = 1.18293 / 6.
    # AUROC: positives .492 .312 vs negatives .312 .26 .243 .477:
    #   .492 -> 4, .312 -> 0.5 (tie) + 2;  6.5 of 8 pairs.
    metrics = confidence_metrics(crafted_trace())
    assert metrics.ece[1] == pytest.approx(0.91 / 6, abs=1e-6)
    assert metrics.brier[1] == pytest.approx(1.18293 / 6, abs=1e-6)
    assert metrics.auroc[1] == pytest.approx(6.5 / 8)
    np.testing.assert_allclose(metrics.survival_rate, [4 / 6, 2 / 6])
    assert metrics.num_rounds == 6


def test_scalar_metrics_direct():
    # AUROC of all-tied scores is 1/2; a perfectly separated one is 1; one class is undefined.
    assert auroc([0.3, 0.3, 0.3, 0.3], [1, 0, 1, 0]) == pytest.approx(0.5)
    assert auroc([0.9, 0.8, 0.1], [1, 1, 0]) == pytest.approx(1.0)
    assert np.isnan(auroc([0.2, 0.4], [1, 1]))
    # p = 1 falls in the last bin; ECE of exact predictions is 0.
    assert expected_calibration_error([1.0, 0.0], [1, 0]) == 0.0
    assert brier_score([1.0, 0.5], [0, 1]) == pytest.approx((1 + 0.25) / 2)


def test_acceptance_by_position():
    trace = crafted_trace()
    # accepted > 0: 4 of 6 reached; accepted > 1: 2 of the 4 rounds with accepted >= 1.
    np.testing.assert_allclose(conditional_acceptance(trace), [4 / 6, 2 / 4])
    np.testing.assert_allclose(accept_rate_at_k(trace), [4 / 6, 2 / 6])
    none_reach = AcceptanceTrace.create(np.zeros((2, 3)), [0, 0])
    assert np.isnan(conditional_acceptance(none_reach)[1:]).all()


def test_threshold_sweep_by_hand():
    # t = 0: full block, 12 verified, accepted sum min(acc, 2) = 6.
    # t = .51: lengths 2 2 1 0 2 2 (r2 stops at c1 = .5, r3 at c0 = .27) -> accepted 2+1+0+0+2+1.
    # t = .55: only r0 (.82, .6) passes -> 2 verified, 2 accepted.
    # t = .85: nothing verified.
    sweep = threshold_sweep(crafted_trace(), [0.0, 0.51, 0.55, 0.85])
    np.testing.assert_array_equal(sweep.verified, [12, 9, 2, 0])
    np.testing.assert_array_equal(sweep.accepted, [6, 6, 2, 0])
    np.testing.assert_array_equal(sweep.rejected, [6, 3, 0, 0])
    np.testing.assert_allclose(sweep.acceptance[:3], [0.5, 6 / 9, 1.0])
    assert np.isnan(sweep.acceptance[3])
    assert sweep.to_dict()["acceptance"][3] is None


def test_threshold_sweep_matches_engine_policy():
    rng = np.random.default_rng(0)
    logits = rng.normal(1.0, 2.0, (50, 7)).astype(np.float32)
    trace = AcceptanceTrace.create(logits, rng.integers(0, 8, 50))
    c = 1 / (1 + np.exp(-logits.astype(np.float64)))
    for t in (0.0, 0.3, 0.7):
        lengths = np.asarray(threshold_proposal_len(c.astype(np.float32), t))
        sweep = threshold_sweep(trace, [t])
        assert sweep.verified[0] == lengths.sum()
        assert sweep.accepted[0] == np.minimum(trace.num_accepted, lengths).sum()


def test_bad_inputs():
    with pytest.raises(ValueError, match="empty"):
        AcceptanceTrace.create(np.zeros((0, 3)), np.zeros(0, int))
    with pytest.raises(ValueError, match=r"\[n, P\]"):
        AcceptanceTrace.create(np.zeros(3), [0, 0, 0])
    with pytest.raises(ValueError, match="0..3"):
        AcceptanceTrace.create(np.zeros((2, 3)), [0, 4])
    with pytest.raises(ValueError, match="integer array"):
        AcceptanceTrace.create(np.zeros((2, 3)), [0, 1, 2])
    with pytest.raises(ValueError, match="same length"):
        expected_calibration_error([0.1, 0.2], [1])
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        brier_score([1.5], [1])
    with pytest.raises(ValueError, match="no samples"):
        auroc([], [])
