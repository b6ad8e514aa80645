"""Teacher-forced metrics of a drafter on held-out data (DSPARK_SPEC.md section 5, Metrics).

``heldout_metrics(drafter, data_dir, train_cfg)`` packs one epoch of a prepared data folder with
a fixed seed (the same anchors for every drafter evaluated with the same settings), runs the
training forward without gradients and reduces the loss sums over the whole epoch, so the
numbers are those of one large batch: tau_probabilistic, accept_rate@k and each loss term.
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
from dspark_jax.training.pipeline import make_pipeline


def heldout_metrics(drafter: Drafter, data_dir: str | os.PathLike | Sequence[str | os.PathLike],
                    train_cfg, *, batch_size: int | None = None, seed: int = 0,
                    max_batches: int | None = None, progress: bool = True) -> dict[str, float]:
    """Metrics of ``drafter`` over one epoch of ``data_dir`` (never shuffled differently).

    Args:
      drafter: the drafter to evaluate (its target gives the features online).
      data_dir: a prepared data folder (or several) not used for training.
      train_cfg: the training settings (pack_length, anchors_per_row, loss weights,
        anchor_chunk); ``batch_size`` defaults to ``train_cfg.global_batch_size``.
      seed: packing and anchor seed (keep it fixed to compare drafters on the same anchors).
      max_batches: stop earlier (None: one epoch).

    Returns:
      ``losses.metrics`` of the summed epoch, as floats, plus ``batches``.
    """
    target = drafter.target
    cfg = drafter.config
    data = make_pipeline(data_dir, batch_size=batch_size or train_cfg.global_batch_size,
                         pack_length=train_cfg.pack_length,
                         anchors_per_row=train_cfg.anchors_per_row,
                         anchors_per_sequence=cfg.num_anchors, block_size=cfg.block_size,
                         seed=seed)
    sums_fn = jax.jit(lambda params, target_state, batch: train_step.loss_sums_fn(
        params, drafter.graphdef, target.graphdef, target_state, batch, train_cfg,
        anchor_chunk=train_cfg.anchor_chunk, compute_dtype=target.dtype))
    total, batches = None, 0
    bar = tqdm(desc="held-out", unit="batch", disable=not progress)
    while data.epoch == 0 and (max_batches is None or batches < max_batches):
        sums = sums_fn(drafter.state, target.state, next(data))
        total = sums if total is None else jax.tree.map(jnp.add, total, sums)
        batches += 1
        bar.update()
    bar.close()
    out = {k: float(v) for k, v in jax.device_get(losses.metrics(total, train_cfg)).items()}
    out["batches"] = batches
    return out
