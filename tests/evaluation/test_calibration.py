"""Tests for dspark_jax.evaluation.calibration (STS, spec section 8) and the trace file."""

from __future__ import annotations

import json

import numpy as np
import pytest

from dspark_jax.evaluation import (
    CALIBRATION_FILE,
    AcceptanceTrace,
    auroc,
    calibrate,
    concatenate_traces,
    confidence_metrics,
    fit_sts,
    load_calibration,
    per_step_confidence,
    save_calibration,
    scale_logits,
    scale_trace,
    split_by_request,
    survival_labels,
)

P = 5


def synthetic(num_requests=400, rounds_per_request=50, seed=0):
    """(overconfident trace, true-probability trace) of the same rounds.

    Per-step true survival s ~ sigmoid(N(1, 1.5)); the verifier accepts position k with
    probability s_k given the earlier positions survived.  The estimator reports 3 logit(s).
    """
    rng = np.random.default_rng(seed)
    n = num_requests * rounds_per_request
    s = 1 / (1 + np.exp(-rng.normal(1.0, 1.5, (n, P))))
    survive = rng.random((n, P)) < s
    accepted = np.where(survive.all(axis=1), P, np.argmin(survive, axis=1))
    ids = np.repeat(np.arange(num_requests), rounds_per_request)
    logit = np.log(s / (1 - s))
    return (AcceptanceTrace.create(3 * logit, accepted, ids),
            AcceptanceTrace.create(logit, accepted, ids))


@pytest.fixture(scope="module")
def fitted():
    overconfident, truth = synthetic()
    temperatures, fit = calibrate(overconfident, fit_fraction=0.5, seed=0)
    return overconfident, truth, temperatures, fit


def test_sts_recovers_the_temperature_and_reaches_the_noise_floor(fitted):
    overconfident, truth, temperatures, fit = fitted
    assert temperatures.shape == (P,)
    assert 2.5 < temperatures[0] < 3.5
    _, heldout_truth = split_by_request(truth, 0.5, 0)  # same split: same ids and seed
    floor = confidence_metrics(heldout_truth).ece  # ECE of the true probabilities
    before = np.array(fit["heldout"]["before"]["ece"])
    after = np.array(fit["heldout"]["after"]["ece"])
    assert np.all(before > 0.1)
    assert np.all(after < floor + 0.01), (after, floor)
    assert fit["heldout_rounds"] + fit["fit_rounds"] == overconfident.num_rounds


def test_sts_keeps_the_ranking(fitted):
    overconfident, _, temperatures, fit = fitted
    _, heldout = split_by_request(overconfident, 0.5, 0)
    calibrated = scale_trace(heldout, temperatures)
    labels = survival_labels(heldout)
    raw_c, cal_c = per_step_confidence(heldout), per_step_confidence(calibrated)
    for k in range(P):  # each position's per-step confidences keep their order
        assert auroc(cal_c[:, k], labels[:, k]) == pytest.approx(
            auroc(raw_c[:, k], labels[:, k]), abs=1e-6)
    before, after = fit["heldout"]["before"]["auroc"], fit["heldout"]["after"]["auroc"]
    assert after[0] == pytest.approx(before[0], abs=1e-6)  # cumulative = per-step at k = 0
    # Later cumulative products mix several temperatures: the ranking can move, but little.
    np.testing.assert_allclose(after, before, atol=0.02)


def test_fit_sts_prefers_one_without_signal():
    # Every temperature gives the same ECE when all logits are 0: keep T = 1.
    trace = AcceptanceTrace.create(np.zeros((20, 3)), np.arange(20) % 4)
    np.testing.assert_allclose(fit_sts(trace), 1.0)


def test_fit_sts_keeps_one_where_too_few_rounds_survive():
    overconfident, _ = synthetic(num_requests=40, rounds_per_request=50)
    survivors = survival_labels(overconfident).sum(axis=0)
    cut = int(survivors[2]) + 1  # positions 0-1 have enough survivors, 2-4 do not
    assert survivors[1] >= cut
    temperatures = fit_sts(overconfident, min_survivors=cut)
    assert np.all(temperatures[:2] > 2.0), temperatures  # the 3x overconfidence is fitted
    np.testing.assert_array_equal(temperatures[2:], 1.0)
    np.testing.assert_array_equal(fit_sts(overconfident, min_survivors=0)[:2], temperatures[:2])


def test_scale_logits_shapes():
    z = np.array([[3.0, -2.0], [1.0, 4.0]])
    np.testing.assert_allclose(scale_logits(z, [3.0, 2.0]), [[1.0, -1.0], [1 / 3, 2.0]],
                               rtol=1e-6)
    with pytest.raises(ValueError, match="2 proposals"):
        scale_logits(z, [1.0, 2.0, 3.0])
    with pytest.raises(ValueError, match="> 0"):
        scale_logits(z, [1.0, 0.0])


def test_calibration_json_round_trip(tmp_path, fitted):
    _, _, temperatures, fit = fitted
    path = save_calibration(tmp_path, temperatures, fit)
    assert path == tmp_path / CALIBRATION_FILE
    payload = json.loads(path.read_text())
    assert set(payload) == {"confidence_temperatures", "fit"}
    for source in (tmp_path, path):
        loaded = load_calibration(source)
        np.testing.assert_array_equal(loaded.temperatures, temperatures)
        assert loaded.fit == fit


def test_calibration_file_errors(tmp_path):
    with pytest.raises(FileNotFoundError):
        load_calibration(tmp_path)
    with pytest.raises(FileNotFoundError):
        save_calibration(tmp_path / "missing", [1.0])
    (tmp_path / CALIBRATION_FILE).write_text('{"fit": {}}')
    with pytest.raises(ValueError, match="not a calibration file"):
        load_calibration(tmp_path)
    (tmp_path / CALIBRATION_FILE).write_text('{"confidence_temperatures": [1.0, -2.0]}')
    with pytest.raises(ValueError, match="> 0"):
        load_calibration(tmp_path)


def test_trace_file_round_trip(tmp_path):
    overconfident, _ = synthetic(num_requests=3, rounds_per_request=4)
    path = overconfident.save(tmp_path / "trace.npz")
    loaded = AcceptanceTrace.load(path)
    for a, b in zip(loaded, overconfident):
        np.testing.assert_array_equal(a, b)
    no_ids = AcceptanceTrace.create(np.zeros((2, 3)), [1, 3])
    assert AcceptanceTrace.load(no_ids.save(tmp_path / "no_ids.npz")).request_ids is None
    with pytest.raises(ValueError, match=".npz"):
        no_ids.save(tmp_path / "trace.json")


def test_split_and_concatenate_keep_requests_apart():
    trace, _ = synthetic(num_requests=10, rounds_per_request=3)
    fit_part, heldout = split_by_request(trace, 0.3, seed=1)
    assert set(fit_part.request_ids).isdisjoint(heldout.request_ids)
    assert len(set(fit_part.request_ids)) == 3 and len(set(heldout.request_ids)) == 7
    again, _ = split_by_request(trace, 0.3, seed=1)
    np.testing.assert_array_equal(again.request_ids, fit_part.request_ids)
    joined = concatenate_traces([fit_part, heldout])
    assert joined.num_rounds == trace.num_rounds
    assert len(set(joined.request_ids)) == 10
    with pytest.raises(ValueError, match="two requests"):
        split_by_request(AcceptanceTrace.create(np.zeros((3, 2)), [0, 1, 2], [7, 7, 7]))
    with pytest.raises(ValueError, match="block sizes"):
        concatenate_traces([trace, AcceptanceTrace.create(np.zeros((1, 2)), [0])])
