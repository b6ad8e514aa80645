"""A drafter checkpoint's ``calibration.json``: its STS temperatures and the fit they came from.

Written by ``dspark-jax calibrate`` (``evaluation.calibration``) into the drafter folder and read
by ``load_drafter``, so every policy reads c_k = sigmoid(z_k / T_k).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import NamedTuple

import numpy as np

CALIBRATION_FILE = "calibration.json"


def check_temperatures(temperatures, block_size: int | None = None) -> np.ndarray:
    """float64 ``[P]`` finite positive temperatures (``P == block_size`` when given)."""
    t = np.asarray(temperatures, np.float64)
    if t.ndim != 1 or t.size == 0:
        raise ValueError(f"temperatures must be a non-empty 1-D array, got shape {t.shape}")
    if block_size is not None and t.size != block_size:
        raise ValueError(f"{t.size} temperatures for a block of {block_size} proposals")
    if not np.all(np.isfinite(t) & (t > 0)):
        raise ValueError(f"temperatures must be finite and > 0, got {t.tolist()}")
    return t


class Calibration(NamedTuple):
    """Contents of ``calibration.json``."""

    temperatures: np.ndarray  # float64 [P]
    fit: dict


def _calibration_path(path) -> Path:
    path = Path(path)
    return path / CALIBRATION_FILE if path.is_dir() else path


def calibration_text(temperatures, fit: dict | None = None) -> str:
    """The contents of ``calibration.json`` for temperatures ``[P]`` and a fit record."""
    payload = {"confidence_temperatures": check_temperatures(temperatures).tolist(),
               "fit": {} if fit is None else fit}
    return json.dumps(payload, indent=2, allow_nan=False) + "\n"


def save_calibration(folder, temperatures, fit: dict | None = None) -> Path:
    """Writes ``folder/calibration.json`` atomically; returns its path.

    Args:
      folder: the drafter checkpoint folder (must exist).
      temperatures: float ``[P]``, finite and positive.
      fit: JSON-serialisable record of the fit (e.g. from :func:`calibrate`).
    """
    folder = Path(folder)
    if not folder.is_dir():
        raise FileNotFoundError(f"no checkpoint folder {folder}")
    path = folder / CALIBRATION_FILE
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(calibration_text(temperatures, fit))
    os.replace(tmp, path)
    return path


def load_calibration(path) -> Calibration:
    """Reads ``calibration.json`` from a checkpoint folder or a direct file path.

    Raises:
      FileNotFoundError: no calibration file.
      ValueError: malformed file or invalid temperatures.
    """
    path = _calibration_path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no {CALIBRATION_FILE} at {path}")
    try:
        payload = json.loads(path.read_text())
        temperatures = payload["confidence_temperatures"]
    except (json.JSONDecodeError, KeyError, TypeError) as err:
        raise ValueError(f"{path} is not a calibration file: {err!r}") from err
    return Calibration(check_temperatures(temperatures), dict(payload.get("fit") or {}))
