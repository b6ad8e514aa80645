"""The paper's confidence figures from acceptance traces (paper Figs. 2, 5 and 6).

Every figure is a JSON-ready dict of the numbers behind it (built by a ``*_data`` function)
written by :func:`write_figure` as ``<name>.json`` beside ``<name>.png``; the PNG is always
drawn from the JSON alone, so :func:`plot_from_json` regenerates it anywhere.

* ``conditional_acceptance``: conditional acceptance per block position, one panel per domain
  (math / code / chat ...), one line per drafter (Fig. 2: suffix decay of a parallel drafter
  vs the flat DSpark curve).
* ``threshold_sweep``: verified draft tokens split into accepted and rejected (hatched) as a
  static confidence threshold rises, one panel per domain, with the acceptance rate (Fig. 5).
* ``reliability``: reliability diagram of the cumulative survival estimate pooled over all
  block positions, raw vs STS-calibrated, over a histogram of the samples per bin (Fig. 6).

Drawing uses matplotlib's object API (``matplotlib.figure.Figure``, Agg PNG output); it never
touches pyplot or the global backend.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
from matplotlib.figure import Figure

from dspark_jax.evaluation.calibration import scale_trace
from dspark_jax.evaluation.metrics import (
    DEFAULT_NUM_BINS,
    DEFAULT_THRESHOLDS,
    conditional_acceptance,
    confidence_metrics,
    cumulative_survival,
    expected_calibration_error,
    reliability_bins,
    survival_labels,
    threshold_sweep,
)
from dspark_jax.evaluation.trace import AcceptanceTrace
from dspark_jax.scheduling.sps import SPSProfile

__all__ = [
    "conditional_acceptance_data",
    "plot_from_json",
    "reliability_data",
    "threshold_sweep_data",
    "write_figure",
]


def _floats(values) -> np.ndarray:
    """float64 array from a JSON list (None -> NaN)."""
    return np.array([np.nan if v is None else v for v in values], np.float64)


def _json_list(values) -> list:
    return [None if np.isnan(v) else float(v) for v in np.asarray(values, np.float64)]


# ----------------------------------------------------------------------------- data


def conditional_acceptance_data(
        traces: Mapping[str, Mapping[str, AcceptanceTrace]]) -> dict:
    """Numbers of the conditional-acceptance figure.

    Args:
      traces: ``{drafter: {domain: trace}}`` (join a domain's benchmarks with
        :func:`dspark_jax.evaluation.concatenate_traces`); drafters may have different ``P``.

    Returns:
      ``{"figure": "conditional_acceptance", "domains": [...], "drafters": {drafter:
      {domain: {"conditional_acceptance": [P values, None where undefined],
      "num_rounds": n}}}}``.
    """
    if not traces or not all(traces.values()):
        raise ValueError("conditional_acceptance_data needs at least one domain per drafter")
    domains = list(dict.fromkeys(d for per_domain in traces.values() for d in per_domain))
    return {
        "figure": "conditional_acceptance",
        "domains": domains,
        "drafters": {
            str(drafter): {
                str(domain): {"conditional_acceptance": _json_list(conditional_acceptance(t)),
                              "num_rounds": t.num_rounds}
                for domain, t in per_domain.items()}
            for drafter, per_domain in traces.items()},
    }


def threshold_sweep_data(traces: Mapping[str, AcceptanceTrace],
                         thresholds: Sequence[float] = DEFAULT_THRESHOLDS) -> dict:
    """Numbers of the threshold-sweep figure.

    Args:
      traces: ``{domain: trace}`` (calibrated or raw, as the engine would threshold them).
      thresholds: ``[m]`` static thresholds (0 = full block).

    Returns:
      ``{"figure": "threshold_sweep", "domains": {domain: ThresholdSweep.to_dict()}}``.
    """
    if not traces:
        raise ValueError("threshold_sweep_data needs at least one domain")
    return {"figure": "threshold_sweep",
            "domains": {str(d): threshold_sweep(t, thresholds).to_dict()
                        for d, t in traces.items()}}


def _reliability_side(trace: AcceptanceTrace, num_bins: int) -> dict:
    probs = cumulative_survival(trace).reshape(-1)
    labels = survival_labels(trace).reshape(-1)
    bins = reliability_bins(probs, labels, num_bins)
    return {"counts": [int(c) for c in bins.counts],
            "mean_prediction": _json_list(bins.mean_prediction),
            "mean_label": _json_list(bins.mean_label),
            "ece": expected_calibration_error(probs, labels, num_bins),
            "positions": confidence_metrics(trace, num_bins).to_dict()}


def reliability_data(trace: AcceptanceTrace, temperatures, num_bins: int = DEFAULT_NUM_BINS,
                     title: str = "") -> dict:
    """Numbers of the reliability diagram, raw vs calibrated with ``temperatures``.

    Every (round, position) pair is one sample: its cumulative survival estimate against its
    realised survival.  Use a split not used for fitting the temperatures.

    Args:
      trace: ``n`` rounds of raw logits.
      temperatures: float ``[P]`` STS temperatures.
      num_bins: ``B`` equal-width bins.
      title: figure title (e.g. the benchmark).

    Returns:
      ``{"figure": "reliability", "title", "num_bins", "temperatures", "raw": side,
      "calibrated": side}`` with ``side = {"counts": [B], "mean_prediction": [B],
      "mean_label": [B], "ece": pooled ECE, "positions": PositionMetrics.to_dict()}``.
    """
    calibrated = scale_trace(trace, temperatures)
    return {"figure": "reliability", "title": str(title), "num_bins": int(num_bins),
            "temperatures": [float(t) for t in np.asarray(temperatures, np.float64)],
            "raw": _reliability_side(trace, num_bins),
            "calibrated": _reliability_side(calibrated, num_bins)}


# ----------------------------------------------------------------------------- drawing


def _plot_conditional_acceptance(data: dict) -> Figure:
    domains = data["domains"]
    fig = Figure(figsize=(4.0 * len(domains), 3.4), layout="constrained")
    axes = fig.subplots(1, len(domains), squeeze=False)[0]
    for ax, domain in zip(axes, domains):
        longest = 1
        for drafter, per_domain in data["drafters"].items():
            if domain in per_domain:
                values = _floats(per_domain[domain]["conditional_acceptance"])
                ax.plot(np.arange(1, values.size + 1), values, marker="o", label=drafter)
                longest = max(longest, values.size)
        ax.set_xlim(0.5, longest + 0.5)  # undefined (NaN) tail positions keep their place
        ax.set_title(domain)
        ax.set_xlabel("block position k")
        ax.set_ylim(0.0, 1.02)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("conditional acceptance")
    axes[-1].legend(loc="lower left")
    return fig


def _plot_threshold_sweep(data: dict) -> Figure:
    domains = data["domains"]
    fig = Figure(figsize=(4.5 * len(domains), 3.6), layout="constrained")
    axes = fig.subplots(1, len(domains), squeeze=False)[0]
    for ax, (domain, sweep) in zip(axes, domains.items()):
        x = np.arange(len(sweep["thresholds"]))
        accepted = np.asarray(sweep["accepted"], np.float64)
        rejected = np.asarray(sweep["rejected"], np.float64)
        ax.bar(x, accepted, color="tab:blue", label="accepted")
        ax.bar(x, rejected, bottom=accepted, color="white", edgecolor="tab:red", hatch="//",
               label="rejected")
        for xi, top, rate in zip(x, accepted + rejected, _floats(sweep["acceptance"])):
            if not np.isnan(rate):
                ax.text(xi, top, f"{100 * rate:.1f}%", ha="center", va="bottom", fontsize=7)
        ax.set_xticks(x, [f"{t:g}" for t in sweep["thresholds"]])
        ax.set_title(domain)
        ax.set_xlabel("confidence threshold")
    axes[0].set_ylabel("verified draft tokens")
    axes[-1].legend(loc="upper right")
    return fig


def _plot_reliability(data: dict) -> Figure:
    num_bins = data["num_bins"]
    centres = (np.arange(num_bins) + 0.5) / num_bins
    fig = Figure(figsize=(8.0, 3.8), layout="constrained")
    axes = fig.subplots(1, 2, sharey=True)
    for ax, side, name in zip(axes, ("raw", "calibrated"), ("raw", "STS calibrated")):
        numbers = data[side]
        hist = ax.twinx()
        hist.bar(centres, numbers["counts"], width=1.0 / num_bins, color="0.85", zorder=0)
        hist.set_yticks([])
        ax.set_zorder(hist.get_zorder() + 1)
        ax.patch.set_visible(False)
        ax.plot([0, 1], [0, 1], "k--", linewidth=1, label="perfect calibration")
        ax.plot(_floats(numbers["mean_prediction"]), _floats(numbers["mean_label"]),
                marker="o", color="tab:blue", label="empirical survival")
        ax.set_xlim(0, 1)
        ax.set_ylim(0, 1)
        ax.set_title(f"{name} (ECE {100 * numbers['ece']:.1f}%)")
        ax.set_xlabel("predicted prefix survival")
    axes[0].set_ylabel("realised prefix survival")
    axes[0].legend(loc="upper left")
    if data["title"]:
        fig.suptitle(data["title"])
    return fig


_PLOTTERS = {
    "conditional_acceptance": _plot_conditional_acceptance,
    "threshold_sweep": _plot_threshold_sweep,
    "reliability": _plot_reliability,
}


# ----------------------------------------------------------------------------- files


def plot_from_json(json_path, png_path=None) -> Path:
    """Draws the PNG of a figure JSON written by :func:`write_figure`.

    Args:
      json_path: the figure's JSON.
      png_path: where to draw (default: beside the JSON, ``.png``).  When it is elsewhere the
        JSON is copied beside it, so every PNG keeps the numbers behind it.

    Returns:
      the PNG path.

    Raises:
      ValueError: not a figure JSON of a known kind.
    """
    json_path = Path(json_path)
    text = json_path.read_text()
    data = json.loads(text)
    kind = data.get("figure") if isinstance(data, dict) else None
    if kind not in _PLOTTERS:
        raise ValueError(f"{json_path} is not a figure JSON (figure = {kind!r}; known: "
                         f"{sorted(_PLOTTERS)})")
    png_path = json_path.with_suffix(".png") if png_path is None else Path(png_path)
    png_path.parent.mkdir(parents=True, exist_ok=True)
    beside = png_path.with_suffix(".json")
    if not beside.exists() or beside.resolve() != json_path.resolve():
        beside.write_text(text)
    _PLOTTERS[kind](data).savefig(png_path, dpi=150, format="png")
    return png_path


def write_figure(data: dict, png_path) -> tuple[Path, Path]:
    """Writes ``data`` (from a ``*_data`` function) as JSON and draws the PNG from that JSON.

    Args:
      data: figure numbers with a ``"figure"`` kind.
      png_path: the PNG path; the JSON goes to the same path with suffix ``.json``.

    Returns:
      (PNG path, JSON path).
    """
    if data.get("figure") not in _PLOTTERS:
        raise ValueError(f"unknown figure kind {data.get('figure')!r}; known: {sorted(_PLOTTERS)}")
    png_path = Path(png_path)
    if png_path.suffix != ".png":
        raise ValueError(f"figures are written as .png, got {png_path}")
    json_path = png_path.with_suffix(".json")
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps(data, indent=2, allow_nan=False) + "\n")
    return plot_from_json(json_path, png_path), json_path


def plot_sps_profile(profile: SPSProfile, path, mode: str = "step") -> Path:
    """PNG of a steps/s table against forward tokens, with the measured points marked."""
    table = profile.table(mode)
    fig = Figure(figsize=(6.4, 4.0))
    ax = fig.subplots()
    ax.plot(np.arange(1, table.shape[0]), table[1:], label=f"table ({mode}, settled)",
            drawstyle="steps-pre" if mode == "step" else "default")
    ax.plot(profile.grid, profile.steps_per_s, "o", label="measured (median)")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("forward batch size B (tokens)")
    ax.set_ylabel("steps / s")
    key = profile.key
    ax.set_title(f"SPS: {key.get('model', '')} {key.get('dtype', '')} on "
                 f"{key.get('device_kind', '')}", fontsize=9)
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120, format="png")
    return path
