"""The steps/s table builder, grid timing, the profile cache and the plot."""

import json

import numpy as np
import pytest

from dspark_jax.evaluation.figures import plot_sps_profile
from dspark_jax.scheduling import prefix_schedule, sps


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
