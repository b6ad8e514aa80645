"""Experiment configs: the schema and DeepSpec's reference values, config files, overrides.

An experiment config is an ml-collections ConfigDict with ``.target`` (a model name or path),
``.drafter`` (the fields of ``dspark_jax.drafter_config``) and ``.train`` (the training
settings: :data:`DSPARK_TRAIN` is their schema, at the reference values of DSPARK_SPEC.md
section 2, plus dspark-jax's own). ``configs/*.py`` define ``get_config()`` returning one, built
by the presets below (:func:`qwen3_dspark`, :func:`gemma4_dspark`, :func:`smollm2_dspark`, ...).

Overrides use dotted paths, ``--train.learning_rate=3e-4`` or ``train.max_steps=10``; values
are parsed as Python literals when they can be (numbers, booleans, tuples) and kept as strings
otherwise, then checked against the field's type by ml-collections. The Qwen3 and Gemma4 configs leave
``.target`` unset (None): it is the user's local copy of the model, required on the command
line (``--target=PATH``), as is ``train.data_dir`` in every config. :func:`check_runnable`
checks that a training config names a target and data that exist (the launch scripts run it
before any host starts).
"""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path
from typing import Sequence

import ml_collections

from dspark_jax import storage
from dspark_jax.checkpoints import registry
from dspark_jax.drafter_config import check_fit, default_drafter_config
from dspark_jax.target import load_target_config
from dspark_jax.training.data import MANIFEST
from dspark_jax.training.recipe import RECIPE_REFERENCE

# Qwen3 drafters: 5 draft layers, block 7 (anchor + 6), vanilla Markov head of rank 256, the
# confidence head, mask token 151669 (Qwen3's first padded embedding row).
QWEN3_DSPARK_DRAFTER = dict(
    mask_token_id=151669, block_size=7, num_layers=5, markov_rank=256, head="markov",
    confidence_head=True, confidence_head_with_markov=True, trainable_mask_embedding=False,
    anchor_predicts=True)
# DeepSpec's Gemma4 drafter (config/dspark/dspark_gemma4_12b.py): the same, with mask token 4
# (Gemma's <mask>); its train settings are the Qwen3 ones.
GEMMA4_DSPARK_DRAFTER = dict(QWEN3_DSPARK_DRAFTER, mask_token_id=4)
# The DFlash baseline is the same model without sequential or confidence head.
DFLASH_DRAFTER_CHANGES = dict(markov_rank=0, head="none", confidence_head=False,
                              confidence_head_with_markov=False)

DSPARK_TRAIN = dict(
    RECIPE_REFERENCE,
    loss_decay_gamma=4.0, ce_loss_alpha=0.1, l1_loss_alpha=0.9, confidence_head_alpha=1.0,
    learning_rate=6e-4, warmup_ratio=0.04, weight_decay=0.0, grad_clip_norm=1.0,
    global_batch_size=512, epochs=10,
    num_anchors=512,        # N, anchors per training sequence
    # dspark-jax's own settings (the trainer, dspark_jax/training/trainer.py):
    data_dir=(),            # folders written by `dspark-jax prepare-data`
    feature_dir=(),         # optional target-feature caches (`dspark-jax prepare-features`),
                            # one per data_dir; empty: the step runs the target online
    max_steps=0,            # 0: epochs x the packed batches of one pass over the data
                            # (trainer.total_steps)
    pack_length=4096,       # tokens per packed row (the reference's max_length)
    anchors_per_row=512,    # anchor slots per packed row
    grad_accum_steps=1,
    anchor_chunk=32,        # anchors per chunk of full-vocabulary logits
    attention="",           # the attention kernels of the packed target forward and of the
                            # drafter (models/fused_attention.py): "" the backend's (splash /
                            # blockwise einsum on TPU, cuDNN on GPU, einsum on CPU)
    compute_dtype="",       # the forward's dtype (trainer.compute_dtype): "" the backend's
                            # (float32 on CPU, bfloat16 on accelerators), float32, bfloat16
    mesh_shape=(-1, 1, 1),  # (data, fsdp, tensor)
    seed=0,
    init_from="",           # a saved drafter to start from (a warm start: new optimizer and
                            # schedule); "": init_drafter and the recipe's initialisation
    log_every=10,
    checkpoint_every=500,
    keep_checkpoints=3,
    heldout_dir=(),         # held-out prepare-data folders for the learning curve (heldout.jsonl)
    heldout_feature_dir=(), # their feature caches (optional, one per heldout_dir): a cheap curve
    heldout_every=0,        # evaluate every this many steps (0: only at step 0 and at the end)
    heldout_batches=0)      # batches of the held-out epoch to use (0: all)
# DFlash trains with cross-entropy only.
DFLASH_TRAIN_CHANGES = dict(ce_loss_alpha=1.0, l1_loss_alpha=0.0, confidence_head_alpha=0.0)

# The embedded default target SmolLM2-135M-Instruct, sized to train on a CPU (see
# configs/dspark_smollm2_135m.py for the reasoning behind each number).
SMOLLM2_DRAFTER = dict(
    target_layer_ids=(1, 8, 14, 21, 27), mask_token_id=49151, block_size=7, num_layers=2,
    markov_rank=32, head="markov", confidence_head=True, confidence_head_with_markov=True,
    trainable_mask_embedding=True, anchor_predicts=True)
SMOLLM2_TRAIN = dict(
    DSPARK_TRAIN, learning_rate=1e-3, global_batch_size=4, epochs=1, num_anchors=64,
    max_steps=150, pack_length=512, anchors_per_row=64, anchor_chunk=16, log_every=5,
    checkpoint_every=50)


def experiment_config(target: str | None, drafter: dict, train: dict) -> ml_collections.ConfigDict:
    """An experiment config: ``.target`` (None: a required string field), ``.drafter`` and
    ``.train``."""
    config = ml_collections.ConfigDict()
    config.target = ml_collections.config_dict.placeholder(str) if target is None else target
    config.drafter = ml_collections.ConfigDict(dict(drafter))
    config.train = ml_collections.ConfigDict(dict(train))
    return config


def qwen3_dspark(target_layer_ids: tuple[int, ...]) -> ml_collections.ConfigDict:
    """DeepSpec's DSpark config for a Qwen3 target (``.target``: required, the local copy)."""
    return experiment_config(None, dict(QWEN3_DSPARK_DRAFTER, target_layer_ids=target_layer_ids),
                      DSPARK_TRAIN)


def gemma4_dspark(target_layer_ids: tuple[int, ...]) -> ml_collections.ConfigDict:
    """DeepSpec's DSpark config for a Gemma4 target (``.target``: required, the local copy)."""
    return experiment_config(None, dict(GEMMA4_DSPARK_DRAFTER, target_layer_ids=target_layer_ids),
                             DSPARK_TRAIN)


def smollm2_dspark() -> ml_collections.ConfigDict:
    """The DSpark drafter of the embedded default target."""
    return experiment_config("smollm2-135m-instruct", SMOLLM2_DRAFTER, SMOLLM2_TRAIN)


def smollm2_dflash() -> ml_collections.ConfigDict:
    """The DFlash baseline of the embedded default target: same data, budget and backbone."""
    return experiment_config("smollm2-135m-instruct", dict(SMOLLM2_DRAFTER, **DFLASH_DRAFTER_CHANGES),
                      dict(SMOLLM2_TRAIN, **DFLASH_TRAIN_CHANGES))


def qwen3_dflash(target_layer_ids: tuple[int, ...]) -> ml_collections.ConfigDict:
    """DeepSpec's DFlash baseline config for a Qwen3 target (``.target``: required)."""
    return experiment_config(
        None, dict(QWEN3_DSPARK_DRAFTER, target_layer_ids=target_layer_ids, **DFLASH_DRAFTER_CHANGES),
        dict(DSPARK_TRAIN, **DFLASH_TRAIN_CHANGES))


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
            if storage.is_remote(folder):  # read by the hosts, which have the credentials
                continue
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
    if config.target in registry.REGISTRY or storage.is_remote(config.target):
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
    Object-store paths (gs://...) are left to the hosts, which read them.

    Args:
      config: an experiment config (``configs/*.py``).
      name: how to name the config in messages (its file).
      root: the folder that relative paths start from.
      paths: False checks only that the fields are set (paths that exist elsewhere).

    Returns:
      The target's model config (read without the weights); None for a registered or remote
      target, or ``paths=False``.

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
