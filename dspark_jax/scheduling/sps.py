"""Steps/s profiling: the SPS(B) table of the hardware-aware schedulers (DSPARK_SPEC.md section 9).

SPS(B) is the engine's decode steps per second when its verification forward carries B tokens
(B = sum over requests of 1 + verified drafts). It is measured once per engine configuration on
a grid of B (the engine's token buckets, since the engine pads a step to the next bucket),
settled (:func:`settled_seconds`: the step time made non-decreasing in B, neighbours whose
repeats cannot tell them apart pooled, so that timing noise does not make the schedulers trade
drafts for a difference that is not there) and expanded to the table ``sps[0..Bmax]`` the
schedulers read (``sps[0]`` is never used):

* ``"step"`` (default): SPS(B) = SPS(smallest grid point >= B), the exact cost model of an
  engine that pads to those grid points;
* ``"linear"``: linear interpolation of the step time between grid points, for grids that are
  only samples of a smooth curve.

Profiles are cached as JSON under ``$DSPARK_JAX_CACHE/sps`` (default ``~/.cache/dspark_jax``),
keyed by what the cost depends on (model, dtype, device kind, buckets, slots, ...); the raw
timings are kept next to the table. What to time is the caller's: the serving engine passes a
function that runs one of its own steps at B tokens (``Engine.profile_sps``).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import statistics
import tempfile
import time
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from dspark_jax.storage import cache_dir

MODES = ("step", "linear")
SETTLE_Z = 2.0  # neighbours closer than this many standard errors of their difference are pooled


@dataclasses.dataclass
class SPSProfile:
    """A measured steps/s curve.

    Attributes:
      key: what the profile was measured for (model, dtype, device kind, buckets, ...).
      grid: the token counts B that were timed, ascending.
      seconds: median step time at each grid point, as measured.
      samples: every timed repeat at each grid point (seconds).
      created: unix time of the measurement.

    The table is built from :attr:`settled_seconds`, not from the raw medians.
    """

    key: dict
    grid: list[int]
    seconds: list[float]
    samples: list[list[float]]
    created: float = 0.0

    @property
    def steps_per_s(self) -> list[float]:
        """The measured medians as steps/s."""
        return [1.0 / s for s in self.seconds]

    @property
    def settled_seconds(self) -> list[float]:
        """Step time per grid point that the table uses (:func:`settled_seconds`)."""
        return settled_seconds(self.samples)

    def table(self, mode: str = "step") -> np.ndarray:
        """float32 [grid[-1] + 1]: SPS by forward tokens (see :func:`sps_table`), from the
        settled step times."""
        return sps_table(self.grid, [1.0 / s for s in self.settled_seconds], mode=mode)

    def to_json(self) -> dict:
        return dict(dataclasses.asdict(self), steps_per_s=self.steps_per_s,
                    settled_seconds=self.settled_seconds, table=self.table().tolist())

    @classmethod
    def from_json(cls, data: dict) -> "SPSProfile":
        return cls(data["key"], [int(b) for b in data["grid"]], [float(s) for s in data["seconds"]],
                   [[float(x) for x in row] for row in data["samples"]], float(data["created"]))


def _median_error(samples: np.ndarray) -> float:
    """Standard error of the median of ``samples``, from their median absolute deviation (a
    normal law's: sigma = 1.4826 MAD, error = 1.2533 sigma / sqrt(n))."""
    mad = np.median(np.abs(samples - np.median(samples)))
    return float(1.2533 * 1.4826 * mad / np.sqrt(samples.size))


def settled_seconds(samples: Sequence[Sequence[float]], *, z: float = SETTLE_Z) -> list[float]:
    """Step times per grid point, non-decreasing along the grid, from the timed repeats.

    Adjacent grid points are pooled (their repeats put together, the pool's median taken) while
    some neighbouring pair is out of order or closer than ``z`` standard errors of the
    difference of their medians, the closest pair first: a larger forward never reads as
    cheaper, and a step the repeats cannot show is not in the table. On a CPU whose verify of
    8 tokens costs what a decode step does, the grid's points merge into one flat level (and the
    schedulers verify whole blocks); an accelerator's cliffs, many standard errors high, stay.

    Args:
      samples: [G][n_g] seconds of each grid point's repeats (``SPSProfile.samples``).
      z: the pooling threshold in standard errors.

    Returns:
      [G] seconds: the median of the pool each grid point ends in.
    """
    if not samples or any(len(row) == 0 for row in samples):
        raise ValueError("every grid point needs at least one timed repeat")
    pools = [np.asarray(row, np.float64) for row in samples]
    sizes = [1] * len(pools)  # grid points per pool

    def distance(left: np.ndarray, right: np.ndarray) -> float:
        gap = float(np.median(right) - np.median(left))
        error = np.hypot(_median_error(left), _median_error(right))
        if error == 0.0:
            return gap if gap <= 0 else np.inf
        return gap / error

    while len(pools) > 1:
        gaps = [distance(pools[i], pools[i + 1]) for i in range(len(pools) - 1)]
        i = int(np.argmin(gaps))
        if gaps[i] >= z:
            break
        pools[i:i + 2] = [np.concatenate(pools[i:i + 2])]
        sizes[i:i + 2] = [sizes[i] + sizes[i + 1]]
    return [float(np.median(pool)) for pool, size in zip(pools, sizes) for _ in range(size)]


def sps_table(grid: Sequence[int], steps_per_s: Sequence[float], *,
              mode: str = "step") -> np.ndarray:
    """Expands steps/s measured at grid points to the full table ``sps[0..grid[-1]]``.

    Args:
      grid: ascending token counts >= 1.
      steps_per_s: SPS at each grid point (> 0).
      mode: ``"step"`` holds each grid point's value for every B down to the previous grid
        point + 1 (an engine padding to the grid); ``"linear"`` interpolates the step time
        1/SPS linearly between grid points and holds the first value below grid[0].

    Returns:
      float32 [grid[-1] + 1]; entry 0 repeats entry 1 (never read by the schedulers).
    """
    grid = np.asarray(grid, np.int64)
    rate = np.asarray(steps_per_s, np.float64)
    if mode not in MODES:
        raise ValueError(f"unknown SPS table mode {mode!r}; choose one of {', '.join(MODES)}")
    if grid.ndim != 1 or grid.size == 0 or grid.shape != rate.shape:
        raise ValueError(f"grid and steps_per_s must be equal-length vectors, got {grid.shape} "
                         f"and {rate.shape}")
    if grid[0] < 1 or np.any(np.diff(grid) <= 0):
        raise ValueError(f"grid must be ascending token counts >= 1, got {grid.tolist()}")
    if not np.all(rate > 0):
        raise ValueError("steps per second must be positive")
    batch = np.arange(1, grid[-1] + 1)
    if mode == "step":
        table = rate[np.searchsorted(grid, batch)]
    else:
        table = 1.0 / np.interp(batch, grid, 1.0 / rate)
    return np.concatenate([table[:1], table]).astype(np.float32)


def measure_grid(time_step: Callable[[int], float], grid: Sequence[int], *, repeats: int = 10,
                 warmup: int = 3, progress: Callable[[str], None] | None = None
                 ) -> tuple[list[int], list[list[float]]]:
    """Times ``time_step(B)`` (seconds of one step at B tokens) on a grid.

    Every grid point first runs ``warmup`` untimed steps; then the repeats go round-robin over
    the grid, so that a slow drift of the machine spreads over all points.

    Returns:
      (grid as ints, samples [len(grid)][repeats] in seconds).
    """
    if repeats < 1 or warmup < 0:
        raise ValueError(f"need repeats >= 1 and warmup >= 0, got {repeats} and {warmup}")
    grid = [int(b) for b in grid]
    for b in grid:
        for _ in range(warmup):
            time_step(b)
    samples: list[list[float]] = [[] for _ in grid]
    for r in range(repeats):
        for i, b in enumerate(grid):
            samples[i].append(float(time_step(b)))
        if progress:
            progress(f"sps repeat {r + 1}/{repeats}")
    return grid, samples


def cache_file(key: dict) -> Path:
    """The JSON file of a profile key under ``$DSPARK_JAX_CACHE/sps``."""
    text = json.dumps(key, sort_keys=True)
    slug = re.sub(r"[^A-Za-z0-9_.-]+", "_", str(key.get("model", "model")))[:60]
    return cache_dir() / "sps" / f"{slug}-{hashlib.sha256(text.encode()).hexdigest()[:16]}.json"


def save_profile(profile: SPSProfile, path: str | os.PathLike) -> Path:
    """Writes the profile JSON atomically."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile("w", dir=path.parent, suffix=".tmp", delete=False) as f:
        json.dump(profile.to_json(), f, indent=1)
    os.chmod(f.name, 0o644)  # NamedTemporaryFile creates 0600
    os.replace(f.name, path)
    return path


def load_profile(path: str | os.PathLike) -> SPSProfile:
    return SPSProfile.from_json(json.loads(Path(path).read_text()))


def cached_profile(key: dict, measure: Callable[[], tuple[list[int], list[list[float]]]], *,
                   refresh: bool = False, cache: bool = True) -> SPSProfile:
    """The cached profile of ``key``, or a new one from ``measure()`` (then cached).

    Args:
      key: JSON-serialisable description of what the timings depend on.
      measure: returns (grid, samples) as :func:`measure_grid` does.
      refresh: measure again even when a cached profile exists.
      cache: read and write the cache at all.
    """
    path = cache_file(key)
    if cache and not refresh and path.exists():
        profile = load_profile(path)
        if profile.key == key:
            return profile
    grid, samples = measure()
    profile = SPSProfile(key, grid, [statistics.median(s) for s in samples], samples, time.time())
    if cache:
        save_profile(profile, path)
    return profile
