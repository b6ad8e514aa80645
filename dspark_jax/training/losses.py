"""The DSpark training loss (DSPARK_SPEC.md section 5, paper Eqs. 8-12).

Per proposal slot of every block: the cross-entropy of the draft logits (backbone + sequential
head bias) against the teacher-forced label, the L1 distance between the draft and target
next-token distributions, the analytic accept rate alpha = clamp(1 - L1 / 2, 0, 1) and the
confidence head's BCE against stop_gradient(alpha). Slots are weighted by
w = eval_mask * exp(-k / loss_decay_gamma) (k counts proposal slots from 0) and

  loss = (ce_alpha * sum w CE + l1_alpha * sum w L1 + conf_alpha * sum w BCE) / (sum w + 1e-6).

Everything is first reduced to sums (:func:`loss_sums`), so micro-batches and shards add up
and the loss is always sum-of-numerators / sum-of-denominators over the global batch.

The full-vocabulary logits are only ever built for a chunk of anchors at a time, inside a
rematerialised ``lax.map`` body: the backward pass recomputes them chunk by chunk instead of
storing [b, N, B, V] activations.

Shapes: b rows, S row length, N anchors per row, B block size, P proposal slots
(B - first_proposal_slot), d hidden size, V vocabulary.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from dspark_jax.models.decoder import Decoder
from dspark_jax.models.drafter import DrafterModel, TrainOutput

EPS = 1e-6
DEFAULT_ANCHOR_CHUNK = 32


def slot_terms(draft_logits: jax.Array, target_logits: jax.Array,
               labels: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Per-slot cross-entropy and L1 distance, in float32.

    Args:
      draft_logits: [..., V] draft logits with the sequential-head bias.
      target_logits: [..., V] target logits at the same slots (no gradient expected).
      labels: int [...] teacher-forced next tokens.

    Returns:
      (ce [...], l1 [...]) with l1 = sum_v |softmax(draft) - softmax(target)|.
    """
    log_p = jax.nn.log_softmax(draft_logits.astype(jnp.float32), axis=-1)
    ce = -jnp.take_along_axis(log_p, labels[..., None], axis=-1)[..., 0]
    p_target = jax.nn.softmax(target_logits.astype(jnp.float32), axis=-1)
    l1 = jnp.sum(jnp.abs(jnp.exp(log_p) - p_target), axis=-1)
    return ce, l1


def accept_rate(l1: jax.Array) -> jax.Array:
    """Analytic accept rate (Eq. 8): clamp(1 - l1 / 2, 0, 1)."""
    return jnp.clip(1.0 - 0.5 * l1, 0.0, 1.0)


def target_slot_index(anchors: jax.Array, block_size: int, first_proposal_slot: int,
                      seq_len: int) -> jax.Array:
    """Row index whose target hidden state predicts each slot's label (spec 4.6).

    Slot k predicts input_ids[anchor + k + 1 - first], so the target's prediction of it comes
    from position anchor + k - first. int [b, N] -> int32 [b, N, B], clipped into [0, S - 1]
    (clipped slots are never in eval_mask).
    """
    index = anchors[:, :, None] + jnp.arange(block_size) - first_proposal_slot
    return jnp.clip(index, 0, seq_len - 1).astype(jnp.int32)


def _split_chunks(x: jax.Array, chunk: int) -> jax.Array:
    """[b, N, ...] -> [ceil(N / chunk), b, chunk, ...], zero-padding the anchor axis."""
    b, n = x.shape[:2]
    x = jnp.pad(x, [(0, 0), (0, -n % chunk)] + [(0, 0)] * (x.ndim - 2))
    return jnp.moveaxis(x.reshape(b, -1, chunk, *x.shape[2:]), 1, 0)


def _join_chunks(y: jax.Array, n: int) -> jax.Array:
    """[num_chunks, b, chunk, ...] -> [b, n, ...] (drops the padding)."""
    y = jnp.moveaxis(y, 0, 1)
    return y.reshape(y.shape[0], -1, *y.shape[3:])[:, :n]


def chunked_slot_terms(drafter: DrafterModel, target: Decoder, out: TrainOutput,
                       target_hidden: jax.Array, anchors: jax.Array,
                       anchor_chunk: int = DEFAULT_ANCHOR_CHUNK) -> tuple[jax.Array, jax.Array]:
    """:func:`slot_terms` for every block, ``anchor_chunk`` anchors at a time.

    Args:
      drafter, target: the drafter and the (frozen) target decoder (LM head, head bias).
      out: ``forward_train(..., with_logits=False)`` output (hidden [b, N, B, d], prev, labels).
      target_hidden: [b, S, d] the target's final-normed last hidden states.
      anchors: int [b, N] the anchors ``out`` was computed for.
      anchor_chunk: anchors per chunk; peak memory is two [b, anchor_chunk, B, V] float32
        logits (recomputed in the backward pass, never stored for all chunks).

    Returns:
      (ce, l1), float32 [b, N, B].
    """
    n = anchors.shape[1]
    chunk = max(1, min(anchor_chunk, n))
    index = target_slot_index(anchors, drafter.cfg.block_size, drafter.first_proposal_slot,
                              target_hidden.shape[1])
    graphdef, states = nnx.split((drafter, target))

    def terms(states, target_hidden, xs):
        drafter, target = nnx.merge(graphdef, states)
        hidden, prev, labels, index = xs
        rows = index.reshape(index.shape[0], -1)
        t_hidden = jnp.take_along_axis(target_hidden, rows[..., None], axis=1)
        t_logits = target.logits(t_hidden.reshape(*index.shape, -1))
        return slot_terms(drafter.logits(target, hidden, prev), t_logits, labels)

    terms = jax.checkpoint(terms, prevent_cse=False)
    xs = tuple(_split_chunks(x, chunk) for x in (out.hidden, out.prev, out.labels, index))
    ce, l1 = jax.lax.map(lambda x: terms(states, target_hidden, x), xs)
    return _join_chunks(ce, n), _join_chunks(l1, n)


def slot_weights(eval_mask: jax.Array, first_proposal_slot: int,
                 loss_decay_gamma: float | None) -> jax.Array:
    """w = eval_mask * exp(-k / gamma), k = slot - first_proposal_slot: bool [..., B] -> float32.

    No decay when gamma is None or <= 0.
    """
    w = eval_mask.astype(jnp.float32)
    if loss_decay_gamma is None or loss_decay_gamma <= 0:
        return w
    k = jnp.maximum(jnp.arange(eval_mask.shape[-1]) - first_proposal_slot, 0)
    return w * jnp.exp(-k.astype(jnp.float32) / float(loss_decay_gamma))


def reduce_terms(ce: jax.Array, l1: jax.Array, confidence: jax.Array | None, eval_mask: jax.Array,
                 *, first_proposal_slot: int, loss_decay_gamma: float | None) -> dict[str, jax.Array]:
    """Per-slot terms -> the loss numerators/denominators and metric sums.

    Args:
      ce, l1: float32 [b, N, B] from :func:`slot_terms`.
      confidence: float32 [b, N, B] confidence logits, or None (no confidence head).
      eval_mask: bool [b, N, B] (only proposal slots, contiguous valid prefixes).
      first_proposal_slot: 0 (the anchor slot predicts) or 1.
      loss_decay_gamma: the slot decay constant.

    Returns:
      A dict of float32 sums over the batch, to be added over micro-batches / shards:
        weight [] sum w (the common denominator); ce, l1, confidence [] sum w * term
        (confidence 0 without a head); tokens [] valid slots; blocks [] blocks with at least one
        valid slot; tau [] sum over those blocks of 1 + sum_k prod_{j<=k} alpha_j;
        accept [P], slot_tokens [P] sum of alpha and count of valid slots per proposal slot;
        confidence_error [] sum over valid slots of |sigmoid(confidence) - alpha|.
    """
    valid = eval_mask.astype(jnp.float32)
    w = slot_weights(eval_mask, first_proposal_slot, loss_decay_gamma)
    alpha = jax.lax.stop_gradient(accept_rate(l1))
    zero = jnp.zeros((), jnp.float32)
    if confidence is None:
        bce = conf_error = zero
    else:
        bce = jnp.sum(w * optax.sigmoid_binary_cross_entropy(confidence, alpha))
        conf_error = jnp.sum(valid * jnp.abs(jax.nn.sigmoid(jax.lax.stop_gradient(confidence)) - alpha))
    proposal = slice(first_proposal_slot, None)
    valid_alpha = (alpha * valid)[..., proposal]
    has_valid = eval_mask.any(axis=-1).astype(jnp.float32)
    tau = 1.0 + jnp.cumprod(valid_alpha, axis=-1).sum(axis=-1)
    return dict(
        weight=w.sum(), ce=jnp.sum(w * ce), l1=jnp.sum(w * l1), confidence=bce,
        tokens=valid.sum(), blocks=has_valid.sum(), tau=jnp.sum(tau * has_valid),
        accept=valid_alpha.sum(axis=(0, 1)), slot_tokens=valid[..., proposal].sum(axis=(0, 1)),
        confidence_error=conf_error)


def loss_sums(drafter: DrafterModel, target: Decoder, out: TrainOutput, target_hidden: jax.Array,
              anchors: jax.Array, *, loss_decay_gamma: float | None,
              anchor_chunk: int = DEFAULT_ANCHOR_CHUNK) -> dict[str, jax.Array]:
    """The loss sums of one batch (see :func:`reduce_terms`).

    Args:
      drafter, target: drafter and frozen target decoder.
      out: ``drafter.forward_train(target, ..., with_logits=False)``.
      target_hidden: [b, S, d] the target's final-normed last hidden states (no gradient).
      anchors: int [b, N] the anchors passed to ``forward_train``.
      loss_decay_gamma: the train config's ``loss_decay_gamma``.
      anchor_chunk: anchors per chunk of full-vocabulary logits.
    """
    ce, l1 = chunked_slot_terms(drafter, target, out, target_hidden, anchors, anchor_chunk)
    return reduce_terms(ce, l1, out.confidence, out.eval_mask,
                        first_proposal_slot=drafter.first_proposal_slot,
                        loss_decay_gamma=loss_decay_gamma)


def loss_numerator(sums: dict[str, jax.Array], train_cfg) -> jax.Array:
    """ce_alpha * sum w CE + l1_alpha * sum w L1 + conf_alpha * sum w BCE (a float32 scalar).

    Its gradient divided by ``sums["weight"] + EPS`` is the gradient of :func:`total_loss`
    (the weights depend only on the data).
    """
    return (train_cfg.ce_loss_alpha * sums["ce"] + train_cfg.l1_loss_alpha * sums["l1"]
            + train_cfg.confidence_head_alpha * sums["confidence"])


def total_loss(sums: dict[str, jax.Array], train_cfg) -> jax.Array:
    """The DSpark loss: :func:`loss_numerator` / (sum w + 1e-6)."""
    return loss_numerator(sums, train_cfg) / (sums["weight"] + EPS)


def _ratio(num: jax.Array, den: jax.Array) -> jax.Array:
    return num / jnp.maximum(den, EPS)


def metrics(sums: dict[str, jax.Array], train_cfg) -> dict[str, jax.Array]:
    """Logged values from (globally reduced) sums.

    Returns float32 scalars: loss, ce_loss, l1_loss, confidence_loss (each sum w * term /
    (sum w + 1e-6)), accept_rate@k for each proposal slot k (mean alpha over valid slots),
    tau_probabilistic (mean over blocks with a valid slot), confidence_abs_error (mean
    |sigmoid(confidence) - alpha| over valid slots), valid_tokens, valid_blocks.
    """
    den = sums["weight"] + EPS
    out = dict(loss=total_loss(sums, train_cfg), ce_loss=sums["ce"] / den, l1_loss=sums["l1"] / den,
               confidence_loss=sums["confidence"] / den)
    rates = _ratio(sums["accept"], sums["slot_tokens"])
    for k in range(rates.shape[0]):
        out[f"accept_rate@{k}"] = rates[k]
    out["tau_probabilistic"] = _ratio(sums["tau"], sums["blocks"])
    out["confidence_abs_error"] = _ratio(sums["confidence_error"], sums["tokens"])
    out["valid_tokens"] = sums["tokens"]
    out["valid_blocks"] = sums["blocks"]
    return out
