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
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dspark_jax import sharding, storage
from dspark_jax.checkpoints import deepspec
from dspark_jax.checkpoints.errors import CheckpointError
from dspark_jax.checkpoints import calibration_file as calibration
from dspark_jax.checkpoints import draft_vocab_file
from dspark_jax.drafter_config import FIELDS, check_fit, default_drafter_config
from dspark_jax.models import layer_weights
from dspark_jax.models.drafter import DSparkModel, first_proposal_slot
from dspark_jax.target import Target


class Drafter:
    """A DSpark (or DFlash) drafter bound to its target.

    Attributes:
      config: the drafter config (``dspark_jax.drafter_config``).
      model_config: the draft layers' architecture (a target-style config).
      graphdef, state: the split ``DSparkModel`` (``nnx.merge(graphdef, state)`` inside jit).
      target: the Target whose embedding, LM head and taps the drafter uses.
      confidence_temperatures: float32 [P] STS temperatures (``dspark-jax calibrate``), read
        from and saved to ``calibration.json`` in the checkpoint folder; None = uncalibrated.
      calibration_fit: how they were fitted (the file's "fit" record).
      draft_vocab: int32 [V'] the tokens the draft step may propose (``dspark-jax
        draft-vocab``), read from and saved to ``draft_vocab.json``; None = all V.
      draft_vocab_source: how they were chosen (the file's "source" record).
    """

    def __init__(self, config, model_config, state: nnx.State, graphdef, target: Target):
        self.config = config
        self.model_config = model_config
        self.state = state
        self.graphdef = graphdef
        self.target = target
        self.confidence_temperatures = None
        self.calibration_fit = None
        self.draft_vocab = None
        self.draft_vocab_source = None
        self._layouts = layer_weights.Layouts(("layers",), matrices=(("fc", "kernel"),))

    def inference_state(self, weight_dtype=None) -> nnx.State:
        """The state that decoding programs take: :attr:`state`, or with ``weight_dtype`` (e.g.
        bfloat16 under a float32 drafter) its layers' and context projection's matrices in that
        dtype, each matmul rounding its input to it and accumulating in the parameter dtype
        (``layer_weights.with_dtype``). On one CPU device the layer matrices are held one array
        per layer where ``layer_weights.default_layout`` says so for a block's rows (XLA:CPU
        multiplies a bfloat16 matrix fast only in place; a float32 one through
        ``models.cpu_matmul`` where it runs: a SmolLM2 draft step of 8.1 ms against 12.0 ms
        over the stacks, BENCHMARKS.md). The draft law changes in its last bits; rejection
        sampling keeps the output law, and greedy outputs, exact for any draft law. Made once
        per :attr:`state` and dtype, as ``Target.inference_state``."""
        if weight_dtype is not None and jnp.dtype(weight_dtype) == self.dtype:
            weight_dtype = None
        layout = layer_weights.default_layout(self.state, self.config.block_size, weight_dtype)
        return self._layouts.get(self.state, layout, weight_dtype)  # stacked, None: the state

    @property
    def num_proposals(self) -> int:
        """P: draft tokens per block (block_size, less the anchor slot when it does not predict)."""
        return self.config.block_size - first_proposal_slot(self.config)

    def calibrate(self, temperatures, fit: dict | None = None) -> None:
        """Sets the STS confidence temperatures [P] every verification policy then uses."""
        temps = np.asarray(temperatures, np.float32)
        if temps.shape != (self.num_proposals,) or not np.all(temps > 0):
            raise ValueError(f"{temps.size} confidence temperatures {temps.tolist()} for a "
                             f"drafter with {self.num_proposals} proposals (all must be > 0)")
        self.confidence_temperatures = temps
        self.calibration_fit = dict(fit or {})

    def restrict_vocab(self, token_ids, source: dict | None = None) -> None:
        """Drafts from the tokens ``token_ids`` only (None: the whole vocabulary again): the
        draft step computes its LM head and head bias over those V' tokens, V'/V of the cost.
        Exactness is kept: rejection sampling corrects any draft law. Engines built afterwards
        use it.

        Raises:
          ValueError: ids repeated or outside the target's vocabulary.
        """
        if token_ids is None:
            self.draft_vocab = self.draft_vocab_source = None
            return
        self.draft_vocab = draft_vocab_file.check_draft_vocab(token_ids,
                                                              self.target.config.vocab_size)
        self.draft_vocab_source = dict(source or {})

    def __repr__(self):
        c = self.config
        return (f"Drafter({c.num_layers} layers, block {c.block_size}, head={c.head} "
                f"(rank {c.markov_rank}), confidence={c.confidence_head}, "
                f"taps={list(c.target_layer_ids)}"
                + ("" if self.draft_vocab is None else f", draft vocabulary {self.draft_vocab.size}")
                + ")")

    @property
    def model(self) -> DSparkModel:
        return nnx.merge(self.graphdef, self.state)

    @property
    def dtype(self):
        return nnx.to_flat_state(self.state)[0][1].get_value().dtype

    def save(self, path: str | os.PathLike, layout: str = "deepspec", *, dtype=None,
             target_tensors: bool = True, num_anchors: int | None = None) -> storage.AnyPath:
        """Writes the drafter atomically; layout "deepspec", "dflash" (z-lab) or "orbax".

        Args:
          dtype: parameter dtype on disk (default: as held), e.g. jnp.bfloat16 to halve it.
          target_tensors: the deepspec layout carries copies of the target's embedding and LM
            head, as the reference reads them; False leaves them out (a compact folder for
            dspark-jax, which takes them from the target).
          num_anchors: the anchors per training sequence it was trained with, recorded in
            DeepSpec's config.json (the reference trains with the value found there); None
            leaves it out.

        Raises:
          CheckpointError: the layout cannot hold this drafter (dflash with heads).
        """
        state = self.state
        if dtype is not None:
            state = jax.tree.map(
                lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x, state)
        extra = {}
        if self.confidence_temperatures is not None:
            extra[calibration.CALIBRATION_FILE] = calibration.calibration_text(
                self.confidence_temperatures, self.calibration_fit)
        if self.draft_vocab is not None:
            extra[draft_vocab_file.DRAFT_VOCAB_FILE] = draft_vocab_file.draft_vocab_text(
                self.draft_vocab, self.draft_vocab_source)
        return deepspec.save(path, layout=layout, model_cfg=self.model_config, cfg=self.config,
                             state=state, target_state=self.target.state if target_tensors else None,
                             target_config=self.target.config, extra_files=extra,
                             num_anchors=num_anchors)


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
        model = DSparkModel(model_cfg, cfg, dtype=dtype or target.dtype, rngs=nnx.Rngs(seed))
        graphdef, state = nnx.split(model)
    return Drafter(cfg, model_cfg, sharding.shard_state(state), graphdef, target)


# Drafters shipped inside the package (dspark_jax/assets/<name>), loadable by name.
PACKAGED_DRAFTERS = {
    "dspark-smollm2-135m-campaign": "DSpark drafter for smollm2-135m-instruct, the longest "
                                    "trained (launch/smollm2_campaign; BENCHMARKS.md): the "
                                    "demo's and the one to decode with",
    "dspark-smollm2-135m": "DSpark drafter for smollm2-135m-instruct of the paper's comparison "
                           "at one budget (configs/dspark_smollm2_135m.py; BENCHMARKS.md)",
    "dflash-smollm2-135m": "its DFlash baseline, same data and budget "
                           "(configs/dflash_smollm2_135m.py)",
}


def packaged_drafter_path(name: str) -> Path:
    """The folder of a drafter shipped with dspark-jax (``PACKAGED_DRAFTERS``)."""
    return Path(__file__).parent / "assets" / name


def load_drafter(path: str | os.PathLike, target: Target, dtype=None) -> Drafter:
    """Loads a drafter for ``target``: a folder (DeepSpec, z-lab DFlash or Orbax layout) or the
    name of a packaged drafter (``PACKAGED_DRAFTERS``, e.g. "dspark-smollm2-135m").

    The drafter uses the target's embedding and LM head; a DeepSpec folder's copies of them
    that differ from the target's (beyond the rounding of their dtypes) raise a UserWarning.

    Raises:
      CheckpointError: unreadable folder, or a drafter that does not fit the target.
      ValueError: neither a folder nor a packaged drafter name.
    """
    if str(path) in PACKAGED_DRAFTERS:
        path = packaged_drafter_path(str(path))
    elif storage.is_remote(path):
        path = storage.local_folder(path)  # read from this host's local copy
    elif not Path(path).exists():
        raise ValueError(f"no drafter folder {str(path)!r}, and it is not a packaged drafter "
                         f"({', '.join(PACKAGED_DRAFTERS)})")
    model_cfg, cfg, graphdef, state = deepspec.load(path, target.config, dtype or target.dtype)
    if deepspec.detect_layout(path) != "orbax":
        deepspec.warn_on_other_target_tensors(path, cfg, target.state, target.config)
    drafter = Drafter(cfg, model_cfg, sharding.shard_state(state), graphdef, target)
    if (Path(path) / calibration.CALIBRATION_FILE).exists():
        try:
            found = calibration.load_calibration(path)
            drafter.calibrate(found.temperatures, found.fit)
        except ValueError as e:
            raise CheckpointError(f"corrupt {calibration.CALIBRATION_FILE} in {path}: {e}") from e
    if (Path(path) / draft_vocab_file.DRAFT_VOCAB_FILE).exists():
        try:
            found = draft_vocab_file.load_draft_vocab(path, target.config.vocab_size)
        except ValueError as e:
            raise CheckpointError(f"corrupt {draft_vocab_file.DRAFT_VOCAB_FILE} in {path}: {e}") from e
        drafter.restrict_vocab(found.token_ids, found.source)
    return drafter
