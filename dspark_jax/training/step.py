"""The jitted DSpark train step: target features, the loss, AdamW, sharding.

A step runs the frozen target over packed rows (several sequences per row, segment-aware causal
mask, per-sequence RoPE positions) to get the tapped layers and the last hidden states, or takes
them from the batch when it carries cached ones (``features.py``), runs the drafter's
teacher-forced forward on the sampled anchors, and reduces the DSpark loss to sums
(``losses.py``). Gradients are those of the loss numerator, accumulated over micro-batches and
divided once by the global weight sum, so accumulation and data sharding never change the loss.

Usage (pure functional; ``nnx.split`` outside, ``nnx.merge`` inside)::

  optimizer = make_optimizer(train_cfg, total_steps)
  state = init_train_state(drafter.state, optimizer, mesh)
  target_state = jax.device_put(target.state, tree_shardings(target.state, mesh))
  step = make_train_step(drafter.graphdef, target.graphdef, train_cfg, optimizer, mesh=mesh,
                         state=state, target_state=target_state)
  state, metrics = step(state, target_state, batch)

The batch is a dict of arrays (the data pipeline's format):
  input_ids int32 [b, L]; positions int32 [b, L] (restart at 0 per sequence); segment_ids int32
  [b, L] (1, 2, ... per packed sequence, 0 = padding); loss_mask int32 [b, L]; anchors int32
  [b, N] (sorted row indices); keep bool [b, N]; optionally cached target features taps
  [b, L, m*d] and hidden [b, L, d], packed like input_ids (then the target only provides its
  embedding and LM head).
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from dspark_jax import sharding
from dspark_jax.models.decoder import Decoder
from dspark_jax.training import losses, recipe


class TrainState(NamedTuple):
    step: jax.Array  # int32 [] optimizer steps taken
    params: nnx.State  # the drafter's parameters, float32 master weights
    opt_state: optax.OptState


# ----------------------------------------------------------------------------- forward


def target_features(target: Decoder, batch: dict, tap_layer_ids: tuple[int, ...],
                    attention: str | None = None, max_segments: int | None = None):
    """The frozen target's features of packed rows (no gradient), attended within their
    segments by ``attention`` (``fused_attention.IMPLEMENTATIONS``; None: the backend's).
    ``max_segments`` bounds a row's segments (``Decoder.__call__``); None: the batch's anchor
    slots when it has them (every sequence the pipeline packs holds an anchor).

    Returns:
      (taps [b, L, m*d] raw outputs of ``tap_layer_ids``, hidden [b, L, d] final-normed).
    """
    if max_segments is None and "anchors" in batch:
        max_segments = batch["anchors"].shape[-1]
    out = target(batch["input_ids"], batch["positions"], segment_ids=batch["segment_ids"],
                 max_segments=max_segments, attention=attention,
                 tap_layer_ids=tuple(tap_layer_ids))
    return jax.lax.stop_gradient(out.taps), jax.lax.stop_gradient(out.hidden)


def batch_features(target: Decoder, batch: dict, tap_layer_ids: tuple[int, ...], dtype,
                   attention: str | None = None):
    """(taps [b, L, m*d], hidden [b, L, d]) in ``dtype``: the batch's cached features when it
    has them, else :func:`target_features`."""
    if "taps" not in batch:
        return target_features(target, batch, tap_layer_ids, attention)
    d = target.config.hidden_size
    if batch["taps"].shape[-1] != len(tap_layer_ids) * d or batch["hidden"].shape[-1] != d:
        raise ValueError(f"cached features of widths {batch['taps'].shape[-1]} (taps) and "
                         f"{batch['hidden'].shape[-1]} (hidden) do not fit {len(tap_layer_ids)} "
                         f"taps of a target of hidden size {d}")
    return batch["taps"].astype(dtype), batch["hidden"].astype(dtype)


def cast_floats(tree, dtype):
    """Casts the floating-point leaves of ``tree`` to ``dtype``."""
    return jax.tree.map(lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x,
                        tree)


def loss_sums_fn(drafter_params: nnx.State, drafter_graphdef, target_graphdef,
                 target_state: nnx.State, batch: dict, train_cfg, *,
                 anchor_chunk: int = losses.DEFAULT_ANCHOR_CHUNK,
                 compute_dtype=jnp.float32) -> dict[str, jax.Array]:
    """The loss sums (``losses.reduce_terms``) of one batch; parameters are cast to
    ``compute_dtype`` for the forward (gradients come back in the parameters' dtype)."""
    batch = jax.tree.map(jnp.asarray, batch)
    drafter = nnx.merge(drafter_graphdef, cast_floats(drafter_params, compute_dtype))
    target = nnx.merge(target_graphdef, cast_floats(target_state, compute_dtype))
    attention = train_cfg.get("attention") or None
    taps, hidden = batch_features(target, batch, drafter.config.target_layer_ids, compute_dtype,
                                  attention)
    out = drafter.forward_train(
        target, input_ids=batch["input_ids"], taps=taps, anchors=batch["anchors"],
        keep=batch["keep"], loss_mask=batch["loss_mask"], positions=batch["positions"],
        segment_ids=batch["segment_ids"], with_logits=False, attention=attention)
    return losses.loss_sums(drafter, target, out, hidden, batch["anchors"],
                            loss_decay_gamma=train_cfg.loss_decay_gamma,
                            ce_alpha=float(train_cfg.ce_loss_alpha),
                            l1_alpha=float(train_cfg.l1_loss_alpha), anchor_chunk=anchor_chunk)


def loss_fn(drafter_params: nnx.State, drafter_graphdef, target_graphdef, target_state: nnx.State,
            batch: dict, train_cfg, *, anchor_chunk: int = losses.DEFAULT_ANCHOR_CHUNK,
            compute_dtype=jnp.float32) -> tuple[jax.Array, dict[str, jax.Array]]:
    """(DSpark loss of the batch, its sums): differentiate with ``jax.grad(..., has_aux=True)``."""
    sums = loss_sums_fn(drafter_params, drafter_graphdef, target_graphdef, target_state, batch,
                        train_cfg, anchor_chunk=anchor_chunk, compute_dtype=compute_dtype)
    return losses.total_loss(sums, train_cfg), sums


# ----------------------------------------------------------------------------- optimizer


def learning_rate_schedule(train_cfg, total_steps: int) -> Callable[[jax.Array], jax.Array]:
    """Linear warmup over int(warmup_ratio * total_steps) updates (lr * (t + 1) / warmup), then
    cosine decay from learning_rate to 0 at ``total_steps`` (DeepSpec's schedule)."""
    peak = float(train_cfg.learning_rate)
    warmup = int(train_cfg.warmup_ratio * total_steps)
    decay = max(total_steps - warmup, 1)

    def schedule(count):
        count = jnp.asarray(count, jnp.float32)
        progress = jnp.clip((count - warmup) / decay, 0.0, 1.0)
        cosine = 0.5 * peak * (1.0 + jnp.cos(jnp.pi * progress))
        return jnp.where(count < warmup, peak * (count + 1) / max(warmup, 1), cosine)

    return schedule


def make_optimizer(train_cfg, total_steps: int) -> optax.GradientTransformation:
    """AdamW (betas 0.9/0.999, eps 1e-8, decoupled ``weight_decay`` on every trainable
    parameter) with :func:`learning_rate_schedule`, after global-norm clipping to
    ``grad_clip_norm`` (none when it is 0 or unset); ``lr_multipliers`` scale the rate of
    parameter groups (``recipe.scale_groups``)."""
    chain = []
    clip = getattr(train_cfg, "grad_clip_norm", None)
    if clip:
        chain.append(optax.clip_by_global_norm(float(clip)))
    chain.append(optax.adamw(learning_rate_schedule(train_cfg, total_steps), b1=0.9, b2=0.999,
                             eps=1e-8, weight_decay=float(train_cfg.weight_decay)))
    multipliers = tuple(getattr(train_cfg, "lr_multipliers", ()) or ())
    if multipliers:
        chain.append(recipe.scale_groups(multipliers))
    return optax.chain(*chain) if len(chain) > 1 else chain[0]


# ----------------------------------------------------------------------------- sharding


def tree_shardings(tree: Any, mesh: jax.sharding.Mesh) -> Any:
    """NamedShardings for a tree of nnx Variables and plain arrays (a TrainState, a model state):
    Variables by their logical axis names (``sharding.LOGICAL_AXIS_RULES``), the rest
    replicated. Abstract trees (``jax.eval_shape``) work too."""
    def one(x):
        if not isinstance(x, nnx.Variable):
            return NamedSharding(mesh, PartitionSpec())
        shape = jnp.shape(x.get_value())
        names = x.get_metadata().get("out_sharding") or (None,) * len(shape)
        return x.replace(NamedSharding(mesh, sharding.logical_to_spec(names, shape, mesh)))

    return jax.tree.map(one, tree, is_leaf=lambda x: isinstance(x, nnx.Variable))


def batch_sharding(mesh: jax.sharding.Mesh) -> NamedSharding:
    """Batch rows over ('data', 'fsdp'); b must divide evenly."""
    return NamedSharding(mesh, PartitionSpec(("data", "fsdp")))


def init_train_state(drafter_state: nnx.State, optimizer: optax.GradientTransformation,
                     mesh: jax.sharding.Mesh | None = None) -> TrainState:
    """A fresh TrainState: float32 copies of the drafter's parameters (the drafter's own arrays
    are not donated by the step) and the optimizer state, placed on ``mesh`` when given."""
    def init(state):
        params = jax.tree.map(lambda x: jnp.copy(x).astype(jnp.float32), state)
        return TrainState(jnp.zeros((), jnp.int32), params, optimizer.init(params))

    if mesh is None:
        return jax.jit(init)(drafter_state)
    return jax.jit(init, out_shardings=tree_shardings(jax.eval_shape(init, drafter_state), mesh))(
        drafter_state)


# ----------------------------------------------------------------------------- the step


def _micro_batches(batch: dict, count: int, mesh) -> dict:
    """[b, ...] -> [count, b / count, ...]; micro-batch i holds rows i, i + count, ... so each
    one is spread over the data shards like the full batch."""
    def split(x):
        if x.shape[0] % count:
            raise ValueError(f"batch of {x.shape[0]} rows does not split into {count} micro-batches")
        x = x.reshape(x.shape[0] // count, count, *x.shape[1:]).swapaxes(0, 1)
        names = (None, "batch") + (None,) * (x.ndim - 2)
        spec = sharding.logical_to_spec(names, x.shape, mesh)
        return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))

    return jax.tree.map(split, batch)


def make_train_step(drafter_graphdef, target_graphdef, train_cfg,
                    optimizer: optax.GradientTransformation, *, mesh: jax.sharding.Mesh,
                    state: TrainState, target_state: nnx.State, grad_accum_steps: int = 1,
                    anchor_chunk: int = losses.DEFAULT_ANCHOR_CHUNK, compute_dtype=jnp.float32):
    """The jitted train step ``step(state, target_state, batch) -> (state, metrics)``.

    Args:
      drafter_graphdef, target_graphdef: from ``nnx.split`` of the drafter / target.
      train_cfg: the train config (loss_decay_gamma, ce_loss_alpha, l1_loss_alpha,
        confidence_head_alpha).
      optimizer: from :func:`make_optimizer`.
      mesh: a (data, fsdp, tensor) mesh (``sharding.make_mesh``).
      state, target_state: examples (concrete or ``jax.eval_shape``) giving the tree structures
        and logical axis names; parameters and optimizer state are sharded by the logical axis
        rules, batch rows over ('data', 'fsdp'), metrics replicated.
      grad_accum_steps: micro-batches per step (lax.scan); b must be a multiple of it.
      anchor_chunk: anchors per chunk of full-vocabulary logits.
      compute_dtype: forward dtype (bfloat16 on accelerators; the master weights stay float32).

    Returns:
      The jitted step; it donates ``state``. metrics: ``losses.metrics`` of the whole batch
      plus grad_norm (before clipping).
    """
    if grad_accum_steps < 1:
        raise ValueError(f"grad_accum_steps must be >= 1, got {grad_accum_steps}")

    def numerator(params, target_state, batch):
        sums = loss_sums_fn(params, drafter_graphdef, target_graphdef, target_state, batch,
                            train_cfg, anchor_chunk=anchor_chunk, compute_dtype=compute_dtype)
        return losses.loss_numerator(sums, train_cfg), sums

    grad_fn = jax.grad(numerator, has_aux=True)

    def gradients(params, target_state, batch):
        if grad_accum_steps == 1:
            return grad_fn(params, target_state, batch)
        micro = _micro_batches(batch, grad_accum_steps, mesh)
        shapes = jax.eval_shape(grad_fn, params, target_state, jax.tree.map(lambda x: x[0], micro))
        zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)

        def add(total, micro_batch):
            return jax.tree.map(jnp.add, total, grad_fn(params, target_state, micro_batch)), None

        return jax.lax.scan(add, zeros, micro)[0]

    def step(state, target_state, batch):
        grads, sums = gradients(state.params, target_state, batch)
        grads = jax.tree.map(lambda g: g / (sums["weight"] + losses.EPS), grads)
        updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
        metrics = dict(losses.metrics(sums, train_cfg), grad_norm=optax.global_norm(grads))
        return TrainState(state.step + 1, optax.apply_updates(state.params, updates), opt_state), metrics

    state_shardings = tree_shardings(state, mesh)
    return jax.jit(step, donate_argnums=0,
                   in_shardings=(state_shardings, tree_shardings(target_state, mesh),
                                 batch_sharding(mesh)),
                   out_shardings=(state_shardings, NamedSharding(mesh, PartitionSpec())))
