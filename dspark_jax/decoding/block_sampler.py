"""The semi-autoregressive block sampler (DSPARK_SPEC.md section 7.3, paper Eqs. 5-7).

The backbone gives every proposal slot of a block its hidden state h_k and base logits
lm_head(h_k) in one parallel pass; the sequential head then walks the slots left to right in
ONE ``jax.lax.scan``: logits_k = base_k + bias(prev_{k-1} ...), the row is processed by
temperature / top-k / top-p exactly as every other sampler of the project
(:func:`dspark_jax.decoding.sampling.sample`), a token is drawn (argmax when greedy) and becomes
the next step's previous token. The probability row q_k each token was drawn from is returned
for the rejection sampler, together with the confidence logit of the slot.

Temperature, top-p, top-k and the PRNG key are traced arrays: changing them never recompiles.
Step k draws with ``sampling.fold_key(key, k)`` (one key, or a key per row).

A draft vocabulary (:class:`DraftVocab`: V' token ids, the most frequent of the training data,
as FR-Spec and EAGLE-3 draft, with the LM head rows and head columns of those tokens gathered
once) restricts the drafter's LM head and the head's bias to those tokens, so the draft step
reads V'/V of the vocabulary matrix. The draft law q is then the renormalised
law over the V' tokens, zero elsewhere; rejection sampling is exact for any q, so the output
law is unchanged (a target token outside the V' is only ever emitted by the correction). The
block keeps q over the V' columns only (a greedy verify never reads it); a sampled verify
widens it to the vocabulary with :func:`full_vocab_probs`.

Shapes: b rows, P proposal slots, d hidden size, V vocabulary, V' draft vocabulary.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from dspark_jax.decoding.sampling import fold_key, sample
from dspark_jax.models.heads import ConfidenceHead, MarkovHead


class DraftVocab(NamedTuple):
    """A draft vocabulary and the parameters of its tokens (:func:`gather_draft_vocab`)."""

    ids: jax.Array  # int32 [V'] distinct token ids
    lm_head_rows: jax.Array  # [V', d] the target's LM head rows of those tokens
    bias_columns: jax.Array | None  # [r, V'] the sequential head's W2 columns (None: no head)


def gather_draft_vocab(drafter, target, ids: jax.Array) -> DraftVocab:
    """The :class:`DraftVocab` of token ``ids`` int [V'] for a ``DSparkModel`` and its target
    ``Decoder`` (gather it once per set of parameters, not per draft step: the gather of V'
    rows costs more than the matmul it saves)."""
    head = drafter.markov_head
    return DraftVocab(ids, target.lm_head_rows(ids), None if head is None else head.columns(ids))


class BlockSample(NamedTuple):
    tokens: jax.Array  # int32 [b, P] drafted tokens
    probs: jax.Array  # float32 [b, P, V or V'] the exact row q_k each token was sampled from
    confidence: jax.Array | None  # float32 [b, P] confidence logits (None without the head)


def full_vocab_probs(probs: jax.Array, draft_vocab: DraftVocab | None, vocab_size: int) -> jax.Array:
    """Draft rows [..., V'] over a draft vocabulary's tokens as rows [..., V] over the whole
    vocabulary (zero at every other token); rows without a draft vocabulary as they are."""
    if draft_vocab is None:
        return probs
    return jnp.zeros(probs.shape[:-1] + (vocab_size,), probs.dtype).at[..., draft_vocab.ids].set(probs)


def sample_block(*, head: MarkovHead | None, confidence_head: ConfidenceHead | None,
                 confidence_with_markov: bool, hidden: jax.Array, base_logits: jax.Array,
                 anchor_tokens: jax.Array, key: jax.Array, temperature: jax.Array | float = 1.0,
                 top_p: jax.Array | float = 1.0, top_k: jax.Array | int = 0,
                 draft_vocab: DraftVocab | None = None) -> BlockSample:
    """Samples one block of draft tokens.

    Args:
      head: the sequential head (None: no bias, the DFlash baseline).
      confidence_head: the confidence head or None.
      confidence_with_markov: the confidence head reads [h_k; W1[prev_k]] (else h_k alone).
      hidden: [b, P, d] hidden states of the proposal slots.
      base_logits: [b, P, V] lm_head(hidden) (float32); [b, P, V'] with ``draft_vocab``.
      anchor_tokens: int [b], the previous token of slot 0.
      key: PRNG key, or a key per row [b] (``sampling.split_key``).
      temperature, top_p, top_k: scalars or [b] arrays (see ``sampling.sampling_probs``),
        applied to the V' logits under a draft vocabulary.
      draft_vocab: the draft vocabulary, or None (all V).

    Returns:
      BlockSample(tokens [b, P], probs [b, P, V], confidence [b, P] or None); under a draft
      vocabulary the tokens are among ``draft_vocab.ids`` and probs is [b, P, V'], column i the
      probability of token ``draft_vocab.ids[i]`` (:func:`full_vocab_probs` widens it).
    """
    batch = anchor_tokens.shape[0]
    state = (jnp.zeros((batch, 0), jnp.float32) if head is None else head.init_state((batch,)))
    columns = None if draft_vocab is None else draft_vocab.bias_columns

    def step(carry, xs):
        state, prev = carry
        index, h, base = xs
        logits = base.astype(jnp.float32)
        if head is not None:
            state, bias = head.step(state, prev, h, columns)
            logits = logits + bias
        tokens, probs = sample(fold_key(key, index), logits, temperature, top_p, top_k)
        if draft_vocab is not None:
            tokens = draft_vocab.ids[tokens]  # an index into the V' -> the token id
        if confidence_head is None:
            confidence = jnp.zeros((batch,), jnp.float32)
        else:
            confidence = confidence_head(
                h, head.prev_embedding(prev) if confidence_with_markov else None)
        return (state, tokens), (tokens, probs, confidence)

    xs = (jnp.arange(hidden.shape[1]), jnp.moveaxis(hidden, 1, 0), jnp.moveaxis(base_logits, 1, 0))
    _, (tokens, probs, confidence) = jax.lax.scan(
        step, (state, anchor_tokens.astype(jnp.int32)), xs)
    return BlockSample(tokens.T, jnp.moveaxis(probs, 0, 1), None if confidence_head is None else confidence.T)


def sample_draft(drafter, target, *, hidden: jax.Array, anchor_tokens: jax.Array, key: jax.Array,
                 temperature: jax.Array | float = 1.0, top_p: jax.Array | float = 1.0,
                 top_k: jax.Array | int = 0, draft_vocab: DraftVocab | None = None) -> BlockSample:
    """Samples the proposals of blocks drafted by ``DSparkModel.draft``.

    Args:
      drafter: a ``DSparkModel``; target: the target ``Decoder`` (its LM head).
      hidden: [b, B, d] the block's hidden states; slots from ``drafter.first_proposal_slot``
        on are the proposals (P = B or B - 1).
      anchor_tokens: int [b]; key, temperature, top_p, top_k, draft_vocab as in
        :func:`sample_block`.
    """
    proposal = hidden[:, drafter.first_proposal_slot:]
    return sample_block(head=drafter.markov_head, confidence_head=drafter.confidence_head,
                        confidence_with_markov=drafter.config.confidence_head_with_markov,
                        hidden=proposal, base_logits=target.logits(
                            proposal, None if draft_vocab is None else draft_vocab.lm_head_rows),
                        anchor_tokens=anchor_tokens, key=key, temperature=temperature,
                        top_p=top_p, top_k=top_k, draft_vocab=draft_vocab)


def block_confidences(block: BlockSample, temperatures: jax.Array) -> jax.Array:
    """Per-step confidences c_k = sigmoid(z_k / T_k), float32 [b, P], of a block.

    ``temperatures`` [P] are the drafter's STS temperatures (ones when uncalibrated); a drafter
    without a confidence head gets c = 1 everywhere.
    """
    if block.confidence is None:
        return jnp.ones(block.tokens.shape, jnp.float32)
    return jax.nn.sigmoid(block.confidence.astype(jnp.float32) / temperatures)
