"""Teacher-forced metrics of a drafter on held-out data (DSPARK_SPEC.md section 5, Metrics).

``HeldOut(drafter, data_dir, train_cfg)`` packs one epoch of a prepared data folder with a fixed
seed once (the same anchors for every drafter and every call) and jits the training forward
without gradients once; ``.metrics(params)`` reduces the loss sums over the whole epoch, so the
numbers are those of one large batch: tau_probabilistic, accept_rate@k and each loss term. The
trainer uses it for the learning curve (``train.heldout_dir``); ``heldout_metrics`` is the
one-call form.
"""

from __future__ import annotations

import os
from typing import Sequence

import jax
import jax.numpy as jnp
from tqdm.auto import tqdm

from dspark_jax.drafter import Drafter
from dspark_jax.training import losses
from dspark_jax.training import step as train_step
from dspark_jax.training.features import cache_key
from dspark_jax.training.pipeline import make_pipeline


class HeldOut:
    """A fixed held-out epoch and the jitted sums function of one drafter architecture.

    Args:
      drafter: a drafter of the architecture to evaluate (its target gives the features online).
      data_dir: a prepared data folder (or several) not used for training.
      train_cfg: the training settings (pack_length, anchors_per_row, num_anchors, loss weights,
        anchor_chunk); ``batch_size`` defaults to ``train_cfg.global_batch_size``.
      seed: packing and anchor seed (keep it fixed to compare drafters on the same anchors).
      max_batches: keep only the first batches of the epoch (None: the whole epoch).
      feature_dir: feature caches of ``data_dir`` (``prepare-features``, one per folder, same
        order): the evaluation then skips the target forward, which dominates its cost.
    """

    def __init__(self, drafter: Drafter, data_dir: str | os.PathLike | Sequence[str | os.PathLike],
                 train_cfg, *, batch_size: int | None = None, seed: int = 0,
                 max_batches: int | None = None,
                 feature_dir: str | os.PathLike | Sequence[str | os.PathLike] | None = None):
        target = drafter.target
        cfg = drafter.config
        data = make_pipeline(data_dir, batch_size=batch_size or train_cfg.global_batch_size,
                             pack_length=train_cfg.pack_length,
                             anchors_per_row=train_cfg.anchors_per_row,
                             anchors_per_sequence=train_cfg.num_anchors, block_size=cfg.block_size,
                             seed=seed, feature_dir=feature_dir or None,
                             feature_key=cache_key(target, cfg.target_layer_ids) if feature_dir else None)
        self.batches = []
        while data.epoch == 0 and (max_batches is None or len(self.batches) < max_batches):
            self.batches.append(next(data))
        self.train_cfg = train_cfg
        self.target = target
        self._sums = jax.jit(lambda params, target_state, batch: train_step.loss_sums_fn(
            params, drafter.graphdef, target.graphdef, target_state, batch, train_cfg,
            anchor_chunk=train_cfg.anchor_chunk, compute_dtype=target.dtype))

    def metrics(self, params, *, progress: bool = True) -> dict[str, float]:
        """``losses.metrics`` of the summed epoch for drafter parameters ``params``, as floats,
        plus ``batches``."""
        total = None
        for batch in tqdm(self.batches, desc="held-out", unit="batch", disable=not progress):
            sums = self._sums(params, self.target.state, batch)
            total = sums if total is None else jax.tree.map(jnp.add, total, sums)
        out = {k: float(v) for k, v in jax.device_get(losses.metrics(total, self.train_cfg)).items()}
        out["batches"] = len(self.batches)
        return out


def heldout_metrics(drafter: Drafter, data_dir: str | os.PathLike | Sequence[str | os.PathLike],
                    train_cfg, *, batch_size: int | None = None, seed: int = 0,
                    max_batches: int | None = None,
                    feature_dir: str | os.PathLike | Sequence[str | os.PathLike] | None = None,
                    progress: bool = True) -> dict[str, float]:
    """Metrics of ``drafter`` over one epoch of ``data_dir`` (:class:`HeldOut`)."""
    return HeldOut(drafter, data_dir, train_cfg, batch_size=batch_size, seed=seed,
                   max_batches=max_batches, feature_dir=feature_dir).metrics(drafter.state,
                                                                             progress=progress)
