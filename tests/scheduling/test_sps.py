"""The steps/s table builder, grid timing, the profile cache and the plot."""

import json

import numpy as np
import pytest

from dspark_jax.evaluation.figures import plot_sps_profile
from dspark_jax.scheduling import prefix_schedule, production_schedule, sps


def test_step_table_holds_each_bucket_down_to_the_previous_one():
    table = sps.sps_table([1, 2, 4, 8], [10.0, 9.0, 8.0, 4.0])
    np.testing.assert_allclose(table, [10, 10, 9, 8, 8, 4, 4, 4, 4])
    assert table.dtype == np.float32 and table.shape == (9,)


def test_linear_table_interpolates_step_time():
    table = sps.sps_table([2, 4], [10.0, 5.0], mode="linear")  # 0.1 s -> 0.2 s
    np.testing.assert_allclose(table, [10, 10, 10, 1 / 0.15, 5], rtol=1e-6)


@pytest.mark.parametrize("grid,rate,match", [
    ([2, 2], [1.0, 1.0], "ascending"), ([0, 2], [1.0, 1.0], "ascending"),
    ([1, 2], [1.0], "equal-length"), ([1, 2], [1.0, 0.0], "positive")])
def test_table_rejects_bad_input(grid, rate, match):
    with pytest.raises(ValueError, match=match):
        sps.sps_table(grid, rate)
    with pytest.raises(ValueError, match="unknown SPS table mode"):
        sps.sps_table([1], [1.0], mode="cubic")


def test_table_drives_algorithm_1():
    """A cliff after 4 tokens: one request with sure drafts verifies exactly 3."""
    table = sps.sps_table([4, 8], [1.0, 0.3])
    lengths = prefix_schedule(np.ones((1, 7), np.float32), table)
    assert int(lengths[0]) == 3


# The demo's profile on a 2-core AMD EPYC (2026-12-07, ms per round at 1, 2, 4, 8 tokens): a
# verify of 8 costs what one of 1 does there, but the medians (22.86, 22.96, 23.46, 23.41) put
# 4 and 8 tokens 2.5% higher, and the production scheduler verified 6.3 of 7 drafts.
DEMO_SAMPLES_MS = [[25.0, 22.8, 24.7, 21.9, 22.2, 22.9, 24.2, 22.8, 21.9, 23.8],
                   [25.5, 22.3, 23.4, 22.3, 22.2, 23.6, 25.3, 23.8, 22.5, 22.6],
                   [23.8, 23.0, 23.6, 22.9, 23.4, 24.5, 24.7, 24.0, 22.3, 22.2],
                   [28.3, 24.1, 24.9, 22.0, 23.1, 27.2, 23.5, 23.4, 22.9, 22.1]]


def test_settling_pools_what_the_repeats_cannot_tell_apart():
    samples = [[x / 1e3 for x in row] for row in DEMO_SAMPLES_MS]
    settled = sps.settled_seconds(samples)
    assert len(set(settled)) == 1
    assert settled[0] == pytest.approx(np.median(np.concatenate(samples)))
    profile = sps.SPSProfile({}, [1, 2, 4, 8], [float(np.median(r)) for r in samples], samples)
    table = profile.table()
    assert np.all(table == table[1])
    unsure = np.full((1, 7), 0.12, np.float32)  # a chat answer's confidences
    raw = sps.sps_table(profile.grid, profile.steps_per_s)  # the medians as they were measured
    assert int(prefix_schedule(unsure, raw)[0]) == 1
    assert int(production_schedule(unsure, unsure, raw)[0]) == 1
    assert int(prefix_schedule(unsure, table)[0]) == 7
    assert int(production_schedule(unsure, unsure, table)[0]) == 7


def test_settling_keeps_steps_the_repeats_show():
    rng = np.random.default_rng(0)
    means = [0.010, 0.010, 0.0101, 0.020, 0.035]  # an accelerator's cliffs after 4 tokens
    samples = [list(m + 3e-4 * rng.standard_normal(10)) for m in means]
    settled = sps.settled_seconds(samples)
    assert settled[0] == settled[1] == settled[2] == pytest.approx(0.010, abs=2e-4)
    assert settled[3] == pytest.approx(0.020, abs=4e-4) and settled[4] == pytest.approx(0.035, abs=4e-4)


def test_settling_orders_what_timing_put_out_of_order():
    assert sps.settled_seconds([[0.02], [0.01], [0.03]]) == [0.015, 0.015, 0.03]
    assert sps.settled_seconds([[0.01, 0.01], [0.02, 0.02]]) == [0.01, 0.02]  # no noise: kept
    settled = sps.settled_seconds([[0.010, 0.011, 0.012], [0.012, 0.0115, 0.013], [0.009] * 3])
    assert settled == sorted(settled)
    with pytest.raises(ValueError, match="at least one timed repeat"):
        sps.settled_seconds([[0.01], []])


def test_measure_grid_warms_up_then_goes_round_robin():
    calls = []
    grid, samples = sps.measure_grid(lambda b: calls.append(b) or b / 100, [1, 4], repeats=3,
                                     warmup=2)
    assert calls == [1, 1, 4, 4] + [1, 4] * 3
    assert grid == [1, 4] and samples == [[0.01] * 3, [0.04] * 3]


def test_profile_is_cached_by_key(tmp_path, monkeypatch):
    monkeypatch.setenv("DSPARK_JAX_CACHE", str(tmp_path))
    key = dict(model="tiny", dtype="float32", device_kind="cpu", buckets=[1, 2, 4])
    measured = []

    def measure():
        measured.append(1)
        return [1, 2, 4], [[0.010, 0.012, 0.011], [0.02, 0.02, 0.03], [0.05, 0.04, 0.04]]

    profile = sps.cached_profile(key, measure)
    assert profile.seconds == [0.011, 0.02, 0.04]
    path = sps.cache_file(key)
    assert path.parent == tmp_path / "sps" and path.name.startswith("tiny-")
    saved = json.loads(path.read_text())
    assert saved["samples"][2] == [0.05, 0.04, 0.04] and len(saved["table"]) == 5
    assert saved["settled_seconds"] == [0.011, 0.02, 0.04]  # the steps are many errors apart
    again = sps.cached_profile(key, measure)
    assert measured == [1] and again == profile
    np.testing.assert_allclose(again.table(), [1 / 0.011, 1 / 0.011, 50, 25, 25], rtol=1e-6)
    sps.cached_profile(key, measure, refresh=True)
    assert measured == [1, 1]
    sps.cached_profile(dict(key, buckets=[1, 2, 8]), measure, cache=False)
    assert measured == [1, 1, 1] and not sps.cache_file(dict(key, buckets=[1, 2, 8])).exists()


def test_plot_writes_a_png(tmp_path):
    profile = sps.SPSProfile(dict(model="tiny"), [1, 2, 4], [0.01, 0.01, 0.02], [[0.01]] * 3)
    path = plot_sps_profile(profile, tmp_path / "sps.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
