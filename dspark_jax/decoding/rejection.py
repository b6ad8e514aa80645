"""Speculative-decoding verification: rejection sampling of a drafted block against the target.

Rule (spec section 7, step 5), for request ``b`` with ``n = proposal_len[b]`` drafted tokens
``x_0 .. x_{n-1}``, draft laws ``q_k`` (the row ``x_k`` was drawn from) and target laws ``p_k``
(the target's row for position ``k`` given the prefix ``anchor, x_0 .. x_{k-1}``):

* accept ``x_k`` when ``u_k < min(1, p_k(x_k) / q_k(x_k))`` with independent ``u_k ~ U[0, 1)``;
  only the accepted *prefix* counts, and positions ``k >= n`` never count;
* at the first rejected position ``j`` emit a token drawn from ``normalize(max(p_j - q_j, 0))``,
  or from ``p_j`` when that residual mass is below ``RESIDUAL_EPS``;
* when all ``n`` tokens are accepted emit a bonus token drawn from ``p_n``.

The emitted sequence ``x_0 .. x_{j-1}, y`` is then distributed exactly as target sampling.
Greedy decoding needs no special case: with point-mass rows the acceptance ratio is 1 when the
draft equals the target argmax and 0 otherwise, and the residual of two different point masses
is the target's point mass. :func:`verify_logits` (the engine's entry) uses exactly that for
a batch of greedy rows and skips the probability rows (:func:`greedy_verify`).

Everything is batched and jit-able; the first rejection is found with a cumulative product over
the block, the correction row is gathered at that position, and the token is drawn with
:func:`dspark_jax.decoding.sampling.sample_from_probs`. The randomness enters in two places only
(the uniforms and the final categorical draw), so :func:`verify_from_uniforms` exposes the
deterministic part: given the uniforms it returns the decision and the exact law of the emitted
token.
"""

from __future__ import annotations

from typing import NamedTuple

import flax
import jax
import jax.numpy as jnp

from dspark_jax.decoding.sampling import (GREEDY_TEMPERATURE, argmax, sample_from_probs,
                                          sampling_probs, split_key, uniform)

# Below this residual mass the correction row falls back to the target row (spec section 7).
RESIDUAL_EPS = 1e-8


@flax.struct.dataclass
class VerifyResult:
    """Outcome of verifying one drafted block per request.

    Attributes:
      num_accepted: int32 [B], accepted draft tokens, in 0..proposal_len[b].
      next_token: int32 [B], the corrected token at the first rejection, or the bonus token
        when all proposal_len[b] drafted tokens were accepted.
      accepted_mask: bool [B, K], position k accepted; always a prefix of length num_accepted.
    """

    num_accepted: jax.Array
    next_token: jax.Array
    accepted_mask: jax.Array


class VerifyDecision(NamedTuple):
    """Deterministic part of the verification, given the uniforms.

    Attributes:
      num_accepted: int32 [B].
      accepted_mask: bool [B, K] (a prefix).
      next_probs: float32 [B, V], the exact law ``next_token`` is drawn from: the normalized
        residual at the first rejection (or the target row there if the residual mass is below
        RESIDUAL_EPS), or the target row ``proposal_len[b]`` when everything was accepted.
    """

    num_accepted: jax.Array
    accepted_mask: jax.Array
    next_probs: jax.Array


def acceptance_probs(
    draft_tokens: jax.Array, draft_probs: jax.Array, target_probs: jax.Array
) -> jax.Array:
    """``min(1, p_k(x_k) / q_k(x_k))`` at the drafted tokens.

    Args:
      draft_tokens: int [B, K], x_k.
      draft_probs: float [B, K, V], q_k (the law x_k was drawn from).
      target_probs: float [B, K + 1, V] (or [B, K, V]), p_k; only the first K rows are used.

    Returns:
      float32 [B, K]. A token with q_k(x_k) = 0 (it cannot have been drafted, but may appear after
      underflow) gets 1 when p_k(x_k) > 0 and 0 otherwise.
    """
    num_draft_positions = draft_tokens.shape[-1]
    tokens = draft_tokens.astype(jnp.int32)[..., None]
    q_x = jnp.take_along_axis(draft_probs.astype(jnp.float32), tokens, axis=-1)[..., 0]
    p_rows = target_probs[..., :num_draft_positions, :].astype(jnp.float32)
    p_x = jnp.take_along_axis(p_rows, tokens, axis=-1)[..., 0]
    ratio = jnp.minimum(1.0, p_x / jnp.where(q_x > 0, q_x, 1.0))
    return jnp.where(q_x > 0, ratio, jnp.where(p_x > 0, 1.0, 0.0))


def verify_from_uniforms(
    uniforms: jax.Array,
    draft_tokens: jax.Array,
    draft_probs: jax.Array,
    target_probs: jax.Array,
    proposal_len: jax.Array,
) -> VerifyDecision:
    """Accept/reject decision and law of the emitted token for given uniforms.

    Args:
      uniforms: float [B, K], u_k in [0, 1); x_k is accepted iff u_k < acceptance_probs[b, k].
      draft_tokens: int [B, K].
      draft_probs: float [B, K, V], q_k.
      target_probs: float [B, K + 1, V], p_k; row K is the bonus row of a full block.
      proposal_len: int [B] in 0..K; positions >= proposal_len[b] are padding and never accepted.

    Returns:
      VerifyDecision with num_accepted [B], accepted_mask [B, K], next_probs [B, V].
    """
    num_positions = draft_tokens.shape[-1]
    if target_probs.shape[-2] != num_positions + 1:
        raise ValueError(
            f"target_probs needs K + 1 = {num_positions + 1} rows, got {target_probs.shape}"
        )
    proposal_len = proposal_len.astype(jnp.int32)
    draft_probs = draft_probs.astype(jnp.float32)
    target_probs = target_probs.astype(jnp.float32)

    in_block = jnp.arange(num_positions, dtype=jnp.int32) < proposal_len[..., None]
    accept = (uniforms < acceptance_probs(draft_tokens, draft_probs, target_probs)) & in_block
    # Survival of the prefix: position k counts only when 0..k were all accepted.
    accepted_mask = jnp.cumprod(accept.astype(jnp.int32), axis=-1).astype(bool)
    num_accepted = jnp.sum(accepted_mask, axis=-1, dtype=jnp.int32)

    # Position j = num_accepted is the first rejection, or the bonus position when j == n.
    j = num_accepted[..., None, None]
    p_j = jnp.take_along_axis(target_probs, j, axis=-2)[..., 0, :]
    # q has no row K; clamp the gather (that row is only read when j < n <= K, i.e. j < K).
    q_j = jnp.take_along_axis(draft_probs, jnp.minimum(j, num_positions - 1), axis=-2)[..., 0, :]
    residual = jnp.maximum(p_j - q_j, 0.0)
    mass = jnp.sum(residual, axis=-1, keepdims=True)
    rejected = (num_accepted < proposal_len)[..., None]
    use_residual = rejected & (mass >= RESIDUAL_EPS)
    next_probs = jnp.where(use_residual, residual / jnp.where(use_residual, mass, 1.0), p_j)
    return VerifyDecision(num_accepted, accepted_mask, next_probs)


def rejection_sample(
    key: jax.Array,
    draft_tokens: jax.Array,
    draft_probs: jax.Array,
    target_probs: jax.Array,
    proposal_len: jax.Array,
) -> VerifyResult:
    """Verifies a drafted block per request by rejection sampling (spec section 7, step 5).

    Args:
      key: PRNG key, or a key per request [B] (``sampling.split_key``).
      draft_tokens: int32 [B, K], x_k.
      draft_probs: float32 [B, K, V], q_k, the exact row x_k was sampled from.
      target_probs: float32 [B, K + 1, V], p_k, the target row for position k given the prefix
        anchor, x_0 .. x_{k-1}; row proposal_len[b] is the bonus row.
      proposal_len: int32 [B] in 0..K, the number of drafted tokens request b verifies.

    Returns:
      VerifyResult(num_accepted [B], next_token [B], accepted_mask [B, K]).
    """
    key_u, key_next = split_key(key)
    uniforms = uniform(key_u, draft_tokens.shape)
    decision = verify_from_uniforms(uniforms, draft_tokens, draft_probs, target_probs, proposal_len)
    next_token = sample_from_probs(key_next, decision.next_probs)
    return VerifyResult(
        num_accepted=decision.num_accepted,
        next_token=next_token,
        accepted_mask=decision.accepted_mask,
    )


def greedy_verify(draft_tokens: jax.Array, target_tokens: jax.Array,
                  proposal_len: jax.Array) -> VerifyResult:
    """:func:`rejection_sample` of greedy rows, from the target's argmax tokens alone.

    With point-mass rows the acceptance ratio is 1 when x_k is the target's argmax and 0
    otherwise, and both the residual at the first rejection and the bonus row are the target's
    point mass, so the verdict needs no probability rows.

    Args:
      draft_tokens: int32 [B, K]; target_tokens: int32 [B, K + 1], the target's argmax per row;
      proposal_len: int32 [B] in 0..K.
    """
    num_positions = draft_tokens.shape[-1]
    in_block = jnp.arange(num_positions, dtype=jnp.int32) < proposal_len[..., None]
    accept = (draft_tokens == target_tokens[..., :num_positions]) & in_block
    accepted_mask = jnp.cumprod(accept.astype(jnp.int32), axis=-1).astype(bool)
    num_accepted = jnp.sum(accepted_mask, axis=-1, dtype=jnp.int32)
    next_token = jnp.take_along_axis(target_tokens, num_accepted[..., None], axis=-1)[..., 0]
    return VerifyResult(num_accepted=num_accepted, next_token=next_token.astype(jnp.int32),
                        accepted_mask=accepted_mask)


def verify_logits(key: jax.Array, draft_tokens: jax.Array, draft_probs: jax.Array,
                  target_logits: jax.Array, proposal_len: jax.Array, temperature: jax.Array,
                  top_p: jax.Array, top_k: jax.Array) -> VerifyResult:
    """:func:`rejection_sample` against the target's raw logits [B, K + 1, V].

    The target rows get the same processing (``sampling_probs``) as the draft's; when every row
    is greedy the verdict comes from the argmax alone (:func:`greedy_verify`, the same result
    without the [B, K + 1, V] probability rows and the categorical draw).
    temperature, top_p, top_k: per-row parameters [B].
    """
    def sampled():
        target_probs = sampling_probs(target_logits, temperature, top_p, top_k)
        return rejection_sample(key, draft_tokens, draft_probs, target_probs, proposal_len)

    def greedy():
        target_tokens = argmax(target_logits)
        return greedy_verify(draft_tokens, target_tokens, proposal_len)

    return jax.lax.cond(jnp.all(jnp.asarray(temperature) <= GREEDY_TEMPERATURE), greedy, sampled)
