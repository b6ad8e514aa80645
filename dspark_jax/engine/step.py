"""The engine's two jitted programs: admission (batched prefill) and a run of rounds.

Both take the models as (graphdef, state) pairs, merged inside jit (graphdefs static), and the
engine state as explicit pytrees (``decoding.round.Slots`` / ``Caches``), which they return.
:func:`run_rounds` is a ``lax.while_loop`` of scheduler + :func:`decoding.round.verify_round`:
it runs up to ``limit`` rounds and stops early when no slot is active, or, with
``stop_on_finish``, after the first round in which a request ended (so that the host can admit
queued requests into the freed slot), or when a slot's committed length outgrows the cache
``view`` the call's verify attention reads (the host then calls again with a wider view). One
call of ``limit`` 1 is one serving step; an offline batch runs many rounds per call, with no
host round trip between them.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from dspark_jax.decoding.block_sampler import DraftVocab
from dspark_jax.decoding.round import Admissions, Caches, Slots, prefill, verify_round
from dspark_jax.scheduling.verification import policy_proposal_len


class RunSummary(NamedTuple):
    """What a run of rounds did, summed over its rounds."""

    rounds: jax.Array  # int32 rounds run (each one target verify forward)
    verified_tokens: jax.Array  # int32 flat verify tokens over the rounds
    active_slot_rounds: jax.Array  # int32 sum over rounds of the active slots
    bucket_counts: jax.Array  # int32 [len(buckets)] rounds per token bucket


def _models(target_graphdef, target_state, drafter_graphdef, drafter_state):
    target = nnx.merge(target_graphdef, target_state)
    drafter = None if drafter_graphdef is None else nnx.merge(drafter_graphdef, drafter_state)
    return target, drafter


def admit(target_graphdef: nnx.GraphDef, target_state: nnx.State,
          drafter_graphdef: nnx.GraphDef | None, drafter_state: nnx.State | None, slots: Slots,
          caches: Caches, admissions: Admissions, eos_ids: jax.Array, temperatures: jax.Array,
          draft_vocab: DraftVocab | None, *, width: int) -> tuple[Slots, Caches, jax.Array]:
    """:func:`decoding.round.prefill` of ``admissions`` (jit with ``width`` static)."""
    target, drafter = _models(target_graphdef, target_state, drafter_graphdef, drafter_state)
    return prefill(target, drafter, slots, caches, admissions, eos_ids, temperatures, draft_vocab,
                   width=width)


def run_rounds(target_graphdef: nnx.GraphDef, target_state: nnx.State,
               drafter_graphdef: nnx.GraphDef | None, drafter_state: nnx.State | None,
               slots: Slots, caches: Caches, eos_ids: jax.Array, policy_params: dict,
               draft_vocab: DraftVocab | None, limit: jax.Array, stop_on_finish: jax.Array, *,
               buckets: tuple[int, ...], policy, view: int | None = None
               ) -> tuple[Slots, Caches, RunSummary]:
    """Up to ``limit`` rounds (jit with the keyword arguments static).

    Args:
      eos_ids: int32 [E]; policy_params: traced parameters of ``policy``
        (``scheduling.verification.default_params``, with the confidence temperatures [P]).
      draft_vocab: the drafter's ``block_sampler.DraftVocab``, or None (the whole vocabulary).
      limit: int32 most rounds to run; stop_on_finish: bool, stop after a round that ended a
        request.
      buckets: sorted flat token counts of the verify forward, the last one S * (P + 1).
      policy: a verification policy name or function (unused without a drafter).
      view: static cache slots the verify attention reads (None: all): a round runs only while
        every active slot's anchor position is at most ``view``.
    """
    target, drafter = _models(target_graphdef, target_state, drafter_graphdef, drafter_state)
    temps = policy_params["confidence_temperatures"]
    zero = jnp.int32(0)
    summary = RunSummary(zero, zero, zero, jnp.zeros((len(buckets),), jnp.int32))

    def cond(carry):
        slots, _, summary, ended = carry
        in_view = True if view is None else jnp.max(
            jnp.where(slots.active, slots.anchor_pos, 0)) <= view
        return (jnp.any(slots.active) & (summary.rounds < limit)
                & ~(stop_on_finish & ended) & in_view)

    def body(carry):
        slots, caches, s, ended = carry
        if drafter is None:
            proposal_len = jnp.zeros(slots.active.shape, jnp.int32)
        else:
            proposal_len = policy_proposal_len(policy, slots.confidence, slots.history[0],
                                               slots.active, policy_params)
        num_active = jnp.sum(slots.active.astype(jnp.int32))
        slots, caches, out = verify_round(target, drafter, slots, caches, proposal_len, eos_ids,
                                          temps, draft_vocab, buckets=buckets, view=view)
        s = RunSummary(s.rounds + 1, s.verified_tokens + out.verified_tokens,
                       s.active_slot_rounds + num_active, s.bucket_counts.at[out.bucket].add(1))
        return slots, caches, s, ended | jnp.any(out.finished)

    slots, caches, summary, _ = jax.lax.while_loop(cond, body,
                                                   (slots, caches, summary, jnp.bool_(False)))
    return slots, caches, summary
