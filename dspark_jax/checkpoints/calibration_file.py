"""A drafter checkpoint's ``calibration.json``: its STS temperatures and the fit they came from.

Written by ``dspark-jax calibrate`` (``evaluation.calibration``) into the drafter folder and read
by ``load_drafter``, so every policy reads c_k = sigmoid(z_k / T_k).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import NamedTuple

import numpy as np

from dspark_jax.checkpoints.folder_json import read_json_file, write_json_file

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
    return write_json_file(folder, CALIBRATION_FILE, calibration_text(temperatures, fit))


def load_calibration(path) -> Calibration:
    """Reads ``calibration.json`` from a checkpoint folder or a direct file path.

    Raises:
      FileNotFoundError: no calibration file.
      ValueError: malformed file or invalid temperatures.
    """
    _, payload = read_json_file(path, CALIBRATION_FILE, "confidence_temperatures", "calibration")
    return Calibration(check_temperatures(payload["confidence_temperatures"]),
                       dict(payload.get("fit") or {}))
