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
``lax.map`` body, and never in the backward pass: CE and L1 enter the loss linearly with
weights known before the step (alpha * w, data only), so each chunk computes its part of the
loss together with that part's gradient with respect to the draft hidden states, the
sequential head's latents and W2 (:func:`vocab_loss`, a custom VJP: the "fused linear
cross-entropy" of large-vocabulary training). Per chunk that is three vocabulary-sized matmuls
(target logits, draft logits, the gradient's projection back) instead of the five of
rematerialised autodiff, and [b, N, B, V] is never stored. What lies between the matmuls (the
softmaxes, CE, L1 and the logits' gradient) is one kernel on x86 CPUs
(:mod:`dspark_jax.training.cpu_vocab_loss`), jnp elsewhere.

Shapes: b rows, S row length, N anchors per row, B block size, P proposal slots
(B - first_proposal_slot), d hidden size, V vocabulary.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import optax

from dspark_jax.models.decoder import Decoder
from dspark_jax.models.drafter import DSparkModel, TrainOutput
from dspark_jax.models.heads import block_latents
from dspark_jax.training import cpu_vocab_loss

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
    return jnp.moveaxis(x.reshape(b, x.shape[1] // chunk, chunk, *x.shape[2:]), 1, 0)


def _join_chunks(y: jax.Array, n: int) -> jax.Array:
    """[num_chunks, b, chunk, ...] -> [b, n, ...] (drops the padding)."""
    y = jnp.moveaxis(y, 0, 1)
    return y.reshape(y.shape[0], -1, *y.shape[3:])[:, :n]


def _vocab_terms(softcap, head_axes, h, latent, head, w2, t_logits, labels, c_ce, c_l1):
    """Forward of :func:`vocab_loss` with the gradient of its loss: see there for shapes."""
    z = jnp.einsum(f"nd,{head_axes}->nv", h, head, preferred_element_type=jnp.float32)
    if softcap is not None:
        z = softcap * jnp.tanh(z / softcap)
        capped = z  # d z / d base = 1 - (z / cap)^2
    if latent.shape[-1]:
        z = z + jnp.einsum("nr,rv->nv", latent, w2, preferred_element_type=jnp.float32)
    g, ce, l1 = cpu_vocab_loss.slot_terms_and_gradient(z, t_logits.astype(jnp.float32), labels,
                                                       c_ce, c_l1)
    g_base = g if softcap is None else g * (1.0 - jnp.square(capped / softcap))
    dh = jnp.einsum(f"nv,{head_axes}->nd", g_base.astype(head.dtype), head,
                    preferred_element_type=jnp.float32)
    dlatent = jnp.einsum("nv,rv->nr", g.astype(w2.dtype), w2, preferred_element_type=jnp.float32)
    dw2 = jnp.einsum("nr,nv->rv", latent.astype(jnp.float32), g)
    loss = jnp.sum(c_ce * ce + c_l1 * l1)
    return (loss, ce, l1), (dh.astype(h.dtype), dlatent.astype(latent.dtype), dw2.astype(w2.dtype))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def vocab_loss(softcap, head_axes, h, latent, head, w2, t_logits, labels, c_ce, c_l1):
    """sum_n c_ce[n] CE[n] + c_l1[n] L1[n] over slots, and the per-slot CE and L1 (values only).

    Args:
      softcap: the target's final-logit soft-cap (static; None: off), applied to h @ head
        before the head's bias as in the target's and DeepSpec's logits.
      head_axes: how ``head`` is held (static): "dv" for [d, V], "vd" for [V, d] (a tied
        embedding as it is stored: ``Decoder.lm_head_stored``).
      h: [n, d] final-normed draft hidden states; latent: [n, r] the sequential head's latents
        (r = 0 without a head). Draft logits: cap(h @ head) + latent @ w2.
      head: [d, V] or [V, d] the target's LM head (frozen: its cotangent is zero); w2: [r, V].
      t_logits: [n, V] the target's logits at the same slots (no gradient).
      labels: int [n]; c_ce, c_l1: float32 [n] the slots' loss weights (no gradient).

    Returns:
      (loss [], ce [n], l1 [n]) in float32. Only ``loss`` is differentiable: its gradient is
      computed in the forward pass, and the cotangents of ce and l1 are ignored (use them as
      values: metrics, the confidence label).
    """
    return _vocab_terms(softcap, head_axes, h, latent, head, w2, t_logits, labels, c_ce, c_l1)[0]


def _vocab_loss_fwd(softcap, head_axes, h, latent, head, w2, t_logits, labels, c_ce, c_l1):
    # The residuals are the three small gradient pieces only: nothing [n, V] is kept.
    return _vocab_terms(softcap, head_axes, h, latent, head, w2, t_logits, labels, c_ce, c_l1)


def _vocab_loss_bwd(softcap, head_axes, grads, cotangents):
    dh, dlatent, dw2 = grads
    dloss = cotangents[0]
    # None: a zero cotangent for the frozen LM head, the target logits, labels and weights.
    return (dloss.astype(dh.dtype) * dh, dloss.astype(dlatent.dtype) * dlatent, None,
            dloss.astype(dw2.dtype) * dw2, None, None, None, None)


vocab_loss.defvjp(_vocab_loss_fwd, _vocab_loss_bwd)


def chunked_vocab_terms(drafter: DSparkModel, target: Decoder, out: TrainOutput,
                        target_hidden: jax.Array, anchors: jax.Array, c_ce: jax.Array,
                        c_l1: jax.Array, anchor_chunk: int = DEFAULT_ANCHOR_CHUNK):
    """:func:`vocab_loss` over every block, ``anchor_chunk`` anchors at a time.

    Args:
      drafter, target: the drafter and the (frozen) target decoder (LM head).
      out: ``forward_train(..., with_logits=False)`` output (hidden [b, N, B, d], prev, labels).
      target_hidden: [b, S, d] the target's final-normed last hidden states.
      anchors: int [b, N] the anchors ``out`` was computed for.
      c_ce, c_l1: float32 [b, N, B] the slots' CE and L1 loss weights (data only).
      anchor_chunk: anchors per chunk; peak memory is a few [b, anchor_chunk, B, V] float32
        arrays of one chunk.

    Returns:
      (loss [] differentiable, ce [b, N, B], l1 [b, N, B] values).
    """
    n = anchors.shape[1]
    chunk = max(1, min(anchor_chunk, n))
    index = target_slot_index(anchors, drafter.config.block_size, drafter.first_proposal_slot,
                              target_hidden.shape[1])
    head = drafter.markov_head
    latent = (block_latents(head, out.prev, out.hidden) if head is not None
              else jnp.zeros(out.hidden.shape[:-1] + (0,), out.hidden.dtype))
    w2 = (head.markov_w2.kernel[...] if head is not None
          else jnp.zeros((0, drafter.model_config.vocab_size), out.hidden.dtype))
    lm_head, head_axes = target.lm_head_stored()

    def terms(xs):
        hidden, lat, labels, idx, wce, wl1 = xs
        rows = idx.reshape(idx.shape[0], -1)
        t_hidden = jnp.take_along_axis(target_hidden, rows[..., None], axis=1)
        t_logits = target.logits(t_hidden)
        slots = idx.size
        loss, ce, l1 = vocab_loss(target.config.final_logit_softcapping, head_axes,
                                  hidden.reshape(slots, -1), lat.reshape(slots, lat.shape[-1]),
                                  lm_head, w2, t_logits.reshape(slots, -1), labels.reshape(slots),
                                  wce.reshape(slots), wl1.reshape(slots))
        return loss, ce.reshape(idx.shape), l1.reshape(idx.shape)

    xs = tuple(_split_chunks(x, chunk) for x in (out.hidden, latent, out.labels, index, c_ce, c_l1))
    loss, ce, l1 = jax.lax.map(terms, xs)
    return (loss.sum(), jax.lax.stop_gradient(_join_chunks(ce, n)),
            jax.lax.stop_gradient(_join_chunks(l1, n)))


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
                 *, first_proposal_slot: int, loss_decay_gamma: float | None, ce_alpha: float,
                 l1_alpha: float) -> dict[str, jax.Array]:
    """Per-slot terms -> the loss numerators/denominators and metric sums.

    Args:
      ce, l1: float32 [b, N, B] from :func:`slot_terms`.
      confidence: float32 [b, N, B] confidence logits, or None (no confidence head).
      eval_mask: bool [b, N, B] (only proposal slots, contiguous valid prefixes).
      first_proposal_slot: 0 (the anchor slot predicts) or 1.
      loss_decay_gamma: the slot decay constant.
      ce_alpha, l1_alpha: the loss weights of CE and L1.

    Returns:
      A dict of float32 sums over the batch, to be added over micro-batches / shards:
        weight [] sum w (the common denominator); ce, l1, confidence [] sum w * term
        (confidence 0 without a head); vocab [] ce_alpha * ce + l1_alpha * l1 (the loss's
        full-vocabulary part); tokens [] valid slots; blocks [] blocks with at least one
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
    ce_sum, l1_sum = jnp.sum(w * ce), jnp.sum(w * l1)
    return dict(
        weight=w.sum(), ce=ce_sum, l1=l1_sum, vocab=ce_alpha * ce_sum + l1_alpha * l1_sum,
        confidence=bce,
        tokens=valid.sum(), blocks=has_valid.sum(), tau=jnp.sum(tau * has_valid),
        accept=valid_alpha.sum(axis=(0, 1)), slot_tokens=valid[..., proposal].sum(axis=(0, 1)),
        confidence_error=conf_error)


def loss_sums(drafter: DSparkModel, target: Decoder, out: TrainOutput, target_hidden: jax.Array,
              anchors: jax.Array, *, loss_decay_gamma: float | None, ce_alpha: float,
              l1_alpha: float, anchor_chunk: int = DEFAULT_ANCHOR_CHUNK) -> dict[str, jax.Array]:
    """The loss sums of one batch (see :func:`reduce_terms`); ``vocab`` carries the gradient of
    the full-vocabulary terms (:func:`chunked_vocab_terms`), ``ce`` and ``l1`` are values.

    Args:
      drafter, target: drafter and frozen target decoder.
      out: ``drafter.forward_train(target, ..., with_logits=False)``.
      target_hidden: [b, S, d] the target's final-normed last hidden states (no gradient).
      anchors: int [b, N] the anchors passed to ``forward_train``.
      loss_decay_gamma, ce_alpha, l1_alpha: the train config's slot decay and loss weights.
      anchor_chunk: anchors per chunk of full-vocabulary logits.
    """
    first = drafter.first_proposal_slot
    w = slot_weights(out.eval_mask, first, loss_decay_gamma)
    vocab, ce, l1 = chunked_vocab_terms(drafter, target, out, target_hidden, anchors,
                                        ce_alpha * w, l1_alpha * w, anchor_chunk)
    sums = reduce_terms(ce, l1, out.confidence, out.eval_mask, first_proposal_slot=first,
                        loss_decay_gamma=loss_decay_gamma, ce_alpha=ce_alpha, l1_alpha=l1_alpha)
    sums["vocab"] = vocab
    return sums


def loss_numerator(sums: dict[str, jax.Array], train_cfg) -> jax.Array:
    """ce_alpha * sum w CE + l1_alpha * sum w L1 + conf_alpha * sum w BCE (a float32 scalar):
    ``sums["vocab"] + conf_alpha * sums["confidence"]``.

    Its gradient divided by ``sums["weight"] + EPS`` is the gradient of :func:`total_loss`
    (the weights depend only on the data).
    """
    return sums["vocab"] + train_cfg.confidence_head_alpha * sums["confidence"]


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
