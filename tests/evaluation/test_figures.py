"""Tests for dspark_jax.evaluation.figures: every figure regenerates from its JSON alone."""

from __future__ import annotations

import json

import numpy as np
import pytest

from dspark_jax.evaluation import AcceptanceTrace, conditional_acceptance

pytest.importorskip("matplotlib")  # not a core dependency

from dspark_jax.evaluation.figures import (
    conditional_acceptance_data,
    plot_from_json,
    reliability_data,
    threshold_sweep_data,
    write_figure,
)


def random_trace(seed, n=200, block=7):
    rng = np.random.default_rng(seed)
    return AcceptanceTrace.create(rng.normal(2.0, 2.0, (n, block)),
                                  rng.integers(0, block + 1, n), np.arange(n) // 10)


def figure_data():
    domains = {"math": random_trace(0), "code": random_trace(1), "chat": random_trace(2)}
    return {
        "conditional_acceptance": conditional_acceptance_data(
            {"dspark": domains, "dflash": {"math": random_trace(3, block=16),
                                           "chat": random_trace(4)}}),
        "threshold_sweep": threshold_sweep_data(domains, [0.0, 0.5, 0.9, 0.99]),
        "reliability": reliability_data(domains["chat"], np.linspace(1.0, 3.0, 7),
                                        title="chat"),
    }


@pytest.mark.parametrize("kind", ["conditional_acceptance", "threshold_sweep", "reliability"])
def test_figure_regenerates_from_json(tmp_path, kind):
    data = figure_data()[kind]
    png, json_path = write_figure(data, tmp_path / "first" / f"{kind}.png")
    assert png.is_file() and png.stat().st_size > 0
    assert json.loads(json_path.read_text()) == json.loads(json.dumps(data))
    # Regenerate elsewhere from the JSON alone: same numbers beside a new PNG.
    again = plot_from_json(json_path, tmp_path / "second" / f"{kind}.png")
    assert again.is_file() and again.stat().st_size > 0
    assert (tmp_path / "second" / f"{kind}.json").read_text() == json_path.read_text()
    # And in place, after deleting the PNG.
    png.unlink()
    assert plot_from_json(json_path) == png and png.is_file()


def test_figure_numbers():
    data = figure_data()
    trace = random_trace(3, block=16)
    dflash_math = data["conditional_acceptance"]["drafters"]["dflash"]["math"]
    np.testing.assert_allclose(dflash_math["conditional_acceptance"],
                               conditional_acceptance(trace))
    assert data["conditional_acceptance"]["domains"] == ["math", "code", "chat"]
    sweep = data["threshold_sweep"]["domains"]["code"]
    assert sweep["verified"][0] == 200 * 7  # threshold 0 verifies every block in full
    reliability = data["reliability"]
    assert sum(reliability["raw"]["counts"]) == sum(reliability["calibrated"]["counts"]) == 1400


def test_bad_figure_json(tmp_path):
    path = tmp_path / "x.json"
    path.write_text('{"figure": "nope"}')
    with pytest.raises(ValueError, match="not a figure JSON"):
        plot_from_json(path)
    with pytest.raises(ValueError, match="unknown figure kind"):
        write_figure({"figure": "nope"}, tmp_path / "x.png")
