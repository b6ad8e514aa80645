"""Experiment config files (``configs/*.py``) and command-line overrides.

A config file defines ``get_config()`` returning an ml-collections ConfigDict (see
``dspark_jax.presets``). Overrides use dotted paths, ``--train.learning_rate=3e-4`` or
``train.max_steps=10``; values are parsed as Python literals when they can be (numbers,
booleans, tuples) and kept as strings otherwise, then checked against the field's type by
ml-collections. ``check_runnable`` checks that a training config names a target and data that
exist (the launch scripts run it before any host starts).
"""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path
from typing import Sequence

import ml_collections

from dspark_jax.checkpoints import registry
from dspark_jax.drafter_config import check_fit, default_drafter_config
from dspark_jax.target import load_target_config
from dspark_jax.training.data import MANIFEST

# Fields of a training run that no config file can fill in: field -> (what it is, an override).
REQUIRED = {
    "target": ("a local Hugging Face folder, .gguf file or Orbax folder, or a registered "
               "model name", "--target=PATH"),
    "train.data_dir": ("the folders written by `dspark-jax prepare-data`",
                       "--train.data_dir=\"('DIR',)\""),
}


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


def _field(config: ml_collections.ConfigDict, path: str):
    node = config
    for name in path.split("."):
        node = node[name]
    return node


def _folders(value) -> list[str]:
    """A folder field (one path or a sequence of them) as a list."""
    return [value] if isinstance(value, str) else list(value or ())


def _check_folders(config, name: str, root: Path) -> None:
    """Every data and feature folder exists and holds a manifest.json."""
    data, features = _folders(config.train.data_dir), _folders(config.train.get("feature_dir"))
    for field, folders, command in (("train.data_dir", data, "prepare-data"),
                                    ("train.feature_dir", features, "prepare-features")):
        for folder in folders:
            path = root / Path(folder).expanduser()
            if not path.is_dir():
                raise ValueError(f"{name}: {field} folder {path} does not exist")
            if not (path / MANIFEST).is_file():
                raise ValueError(f"{name}: {field} folder {path} holds no {MANIFEST}: run "
                                 f"`dspark-jax {command} --output {path}` first")
    if features and len(features) != len(data):
        raise ValueError(f"{name}: train.feature_dir names {len(features)} folder(s) for "
                         f"{len(data)} train.data_dir folder(s); give one per data folder")


def _check_target(config, name: str, root: Path) -> ml_collections.FrozenConfigDict | None:
    """The target's model config, read without its weights, after checking that the drafter
    fits it; None for a registered name (each host resolves it)."""
    if config.target in registry.REGISTRY:
        return None
    path = root / Path(config.target).expanduser()
    if not path.exists():
        raise ValueError(f"{name}: target {config.target!r} does not exist ({path}): pass a local "
                         "Hugging Face folder, .gguf file or Orbax folder (dspark-jax downloads "
                         "nothing from the Hugging Face hub)")
    try:
        target_config = load_target_config(path)
    except ValueError as e:  # CheckpointError, UnsupportedModelError
        raise ValueError(f"{name}: target {path}: {e}") from e
    fields = config.drafter.to_dict()
    try:
        check_fit(default_drafter_config(target_config, None, **fields), target_config)
    except ValueError as e:
        raise ValueError(f"{name}: the drafter does not fit the target {path}: {e}") from e
    return target_config


def check_runnable(config: ml_collections.ConfigDict, name: str, root: str | Path = ".", *,
                   paths: bool = True) -> ml_collections.FrozenConfigDict | None:
    """Checks that a training config (with its overrides) can run, before anything starts.

    The ``REQUIRED`` fields must be set; with ``paths``, a target path (not a registered name)
    must exist and be readable as a model whose layers and vocabulary fit the drafter config,
    and every ``train.data_dir`` and ``train.feature_dir`` folder must exist and hold a
    manifest.json. Relative paths are taken from ``root`` (where ``dspark-jax train`` will run).

    Args:
      config: an experiment config (``configs/*.py``).
      name: how to name the config in messages (its file).
      root: the folder that relative paths start from.
      paths: False checks only that the fields are set (paths that exist elsewhere).

    Returns:
      The target's model config (read without the weights); None for a registered target or
      ``paths=False``.

    Raises:
      ValueError: naming the config, the field and what to pass.
    """
    missing = [f"{name}: {field} is required: {what} (pass {override})"
               for field, (what, override) in REQUIRED.items() if not _field(config, field)]
    if missing:
        raise ValueError("\n".join(missing))
    if not paths:
        return None
    root = Path(root)
    target_config = _check_target(config, name, root)
    _check_folders(config, name, root)
    return target_config
