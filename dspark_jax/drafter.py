"""The drafter handle: config, split NNX model, and how to create, load and save it.

``init_drafter(target)`` builds a randomly initialised DSpark drafter for any loaded target;
``load_drafter(path, target)`` reads DeepSpec DSpark / DFlash folders, z-lab DFlash folders and
Orbax folders; ``drafter.save(path, layout=...)`` writes them. The drafter never holds the
target's embedding or LM head: it keeps a reference to its target and takes them from there.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Mapping

import ml_collections
from flax import nnx

from dspark_jax import sharding
from dspark_jax.checkpoints import deepspec
from dspark_jax.drafter_config import FIELDS, check_fit, default_drafter_config
from dspark_jax.models.drafter import DrafterModel
from dspark_jax.target import Target


class Drafter:
    """A DSpark (or DFlash) drafter bound to its target.

    Attributes:
      config: the drafter config (``dspark_jax.drafter_config``).
      model_config: the draft layers' architecture (a target-style config).
      graphdef, state: the split ``DrafterModel`` (``nnx.merge(graphdef, state)`` inside jit).
      target: the Target whose embedding, LM head and taps the drafter uses.
    """

    def __init__(self, config, model_config, state: nnx.State, graphdef, target: Target):
        self.config = config
        self.model_config = model_config
        self.state = state
        self.graphdef = graphdef
        self.target = target

    def __repr__(self):
        c = self.config
        return (f"Drafter({c.num_layers} layers, block {c.block_size}, head={c.head} "
                f"(rank {c.markov_rank}), confidence={c.confidence_head}, "
                f"taps={list(c.target_layer_ids)})")

    @property
    def model(self) -> DrafterModel:
        return nnx.merge(self.graphdef, self.state)

    @property
    def dtype(self):
        return nnx.to_flat_state(self.state)[0][1].value.dtype

    def save(self, path: str | os.PathLike, layout: str = "deepspec") -> Path:
        """Writes the drafter atomically; layout "deepspec", "dflash" (z-lab) or "orbax".

        Raises:
          CheckpointError: the layout cannot hold this drafter (dflash with heads).
        """
        return deepspec.save(path, layout=layout, model_cfg=self.model_config, cfg=self.config,
                             state=self.state, target_state=self.target.state,
                             target_config=self.target.config)


def _as_fields(config: Any) -> dict:
    """Drafter fields from a drafter config, an experiment config with ``.drafter``, or a dict."""
    if config is None:
        return {}
    if isinstance(config, (ml_collections.ConfigDict, ml_collections.FrozenConfigDict)):
        config = config.drafter if "drafter" in config else config
        config = config.to_dict() if isinstance(config, ml_collections.ConfigDict) else \
            config.as_configdict().to_dict()
    if not isinstance(config, Mapping):
        raise TypeError(f"config must be a drafter config or a mapping, got {type(config).__name__}")
    return {k: v for k, v in config.items() if k in FIELDS}


def init_drafter(target: Target, config=None, *, seed: int = 0, dtype=None, **overrides) -> Drafter:
    """A randomly initialised drafter for ``target``.

    Args:
      target: a loaded Target.
      config: a drafter config / experiment config (``configs/*.py``) / dict; fields it does
        not set, or None, are derived from the target (``drafter_config.default_drafter_config``: taps spread over the
        layers but never the last, the spare vocabulary row as mask token, else a trainable
        mask embedding).
      seed: parameter init seed.
      dtype: parameter dtype (default: the target's).
      **overrides: drafter config fields, e.g. block_size, num_layers, markov_rank,
        head ("markov", "gated", "rnn", "none"), target_layer_ids, mask_token_id.

    Raises:
      ValueError: an invalid field, or layer ids / mask id that do not fit the target.
    """
    unknown = sorted(set(overrides) - set(FIELDS))
    if unknown:
        raise ValueError(f"unknown drafter config field(s) {', '.join(unknown)}; known: {', '.join(FIELDS)}")
    fields = _as_fields(config)
    if overrides.get("markov_rank") == 0 and overrides.get("head") is None:
        fields.pop("head", None)
    cfg = default_drafter_config(target.config, target.tokenizer, **{**fields, **overrides})
    check_fit(cfg, target.config)
    model_cfg = deepspec.draft_model_config(target.config, cfg.num_layers)
    with sharding.unsharded_init():
        model = DrafterModel(model_cfg, cfg, dtype=dtype or target.dtype, rngs=nnx.Rngs(seed))
        graphdef, state = nnx.split(model)
    return Drafter(cfg, model_cfg, sharding.shard_state(state), graphdef, target)


def load_drafter(path: str | os.PathLike, target: Target, dtype=None) -> Drafter:
    """Loads a drafter folder (DeepSpec, z-lab DFlash or Orbax layout) for ``target``.

    Raises:
      CheckpointError: unreadable folder, or a drafter that does not fit the target.
    """
    model_cfg, cfg, graphdef, state = deepspec.load(path, target.config, dtype or target.dtype)
    return Drafter(cfg, model_cfg, sharding.shard_state(state), graphdef, target)
