"""Experiment config files (``configs/*.py``) and command-line overrides.

A config file defines ``get_config()`` returning an ml-collections ConfigDict (see
``dspark_jax.presets``). Overrides use dotted paths, ``--train.learning_rate=3e-4`` or
``train.max_steps=10``; values are parsed as Python literals when they can be (numbers,
booleans, tuples) and kept as strings otherwise, then checked against the field's type by
ml-collections.
"""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path
from typing import Sequence

import ml_collections


def load_config(path: str | Path) -> ml_collections.ConfigDict:
    """Runs ``get_config()`` of a config file."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"config file {path} does not exist")
    spec = importlib.util.spec_from_file_location(f"dspark_config_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    if not hasattr(module, "get_config"):
        raise ValueError(f"config file {path} defines no get_config()")
    return module.get_config()


def _parse_value(text: str):
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text


def apply_overrides(config: ml_collections.ConfigDict, overrides: Sequence[str]) -> None:
    """Applies ``path=value`` overrides in place.

    Raises:
      ValueError: malformed override or unknown field.
    """
    for override in overrides:
        text = override[2:] if override.startswith("--") else override
        if "=" not in text:
            raise ValueError(f"override {override!r} is not of the form path=value")
        path, value = text.split("=", 1)
        *parents, leaf = path.split(".")
        node = config
        for name in parents:
            if name not in node:
                raise ValueError(f"unknown config field {path!r} (no {name!r})")
            node = node[name]
        if leaf not in node:
            raise ValueError(f"unknown config field {path!r}")
        value = _parse_value(value)
        if isinstance(node[leaf], float) and isinstance(value, int):
            value = float(value)
        if isinstance(node[leaf], tuple) and isinstance(value, list):
            value = tuple(value)
        try:
            node[leaf] = value
        except TypeError as e:
            raise ValueError(f"bad value for {path!r}: {e}") from e
