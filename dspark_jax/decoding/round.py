"""The one decoding round and the batched prefill, as pure functions over explicit pytrees.

Every decoder of the project (``generate``, the serving engine, the data regeneration, the
evaluation) runs these two functions over S slots (DSPARK_SPEC.md section 7); autoregressive
decoding is the same round without a drafter (P = 0 proposals).

Per-slot invariants: ``anchor`` is the last committed token, at ``anchor_pos``; the target and
draft caches hold every committed position < anchor_pos of the slot's row (slot == position,
so stale entries beyond are invisible and overwritten later: rollback is free); ``block`` is the
drafted proposal for positions anchor_pos + 1 .. anchor_pos + P.

:func:`prefill` admits A requests in one program: their prompts are laid out flat, one after
another (segment ids = the admission row of each token), the target runs once over them
(:func:`dspark_jax.models.ragged.ragged_forward`), the first token is sampled and the drafter
drafts the first block from the prompt's taps.

:func:`verify_round`, given how many drafts each slot verifies (the scheduler's choice):
  1. lays the verified tokens [anchor, x_1 .. x_{n_s}] of all slots out flat (the marker
     tensor, :func:`flat_layout`), cut to the smallest token bucket >= sum_s (1 + n_s), and runs
     the target once over them (one ``lax.switch`` branch per bucket);
  2. rejection sampling (``decoding/rejection.py``) accepts a prefix of each slot and draws the
     corrected / bonus token (from the argmax alone when every active slot is greedy);
  3. emits the accepted tokens and the next one, cut at EOS and at the request's limit, into the
     slot's output row, and counts them;
  4. the drafter consumes the taps of each slot's verified inputs and drafts the next block.

Shapes: S slots, P proposals per block (0 without a drafter), Q = P + 1, N cache slots per row,
M output slots per row, V vocabulary, A admitted rows, W prompt width, T flat tokens, R recorded
rounds per request (0: no trace), m*d tap width.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import struct

from dspark_jax import sharding
from dspark_jax.decoding import rejection
from dspark_jax.decoding.block_sampler import (DraftVocab, block_confidences, full_vocab_probs,
                                              sample_draft)
from dspark_jax.decoding.sampling import (GREEDY_TEMPERATURE, SamplingParams, argmax, is_eos,
                                          sample, sampling_probs, split_key)
from dspark_jax.models.kv_cache import KVCache
from dspark_jax.models.ragged import ragged_forward, to_grid


# A new request's lagged confidences until it has its own (its first two rounds): sure drafts,
# so the production scheduler sizes its capacity from the steps/s table alone then. A constant,
# so the capacity still never depends on the tokens being verified (paper Appendix A).
NO_HISTORY = 1.0


@struct.dataclass
class Counters:
    """Per-slot speculative counters of the slot's current request (zeroed at admission)."""

    rounds: jax.Array  # int32 [S] rounds the request was active in
    tau_sum: jax.Array  # int32 [S] accepted + 1 per round (accepted only when EOS ends it)
    accepted: jax.Array  # int32 [S] draft tokens accepted by the verifier
    proposal_len_sum: jax.Array  # int32 [S] draft tokens verified (sum of proposal_len)
    accepted_ge: jax.Array  # int32 [S, P] rounds with accepted >= k + 1
    proposal_len_ge: jax.Array  # int32 [S, P] rounds with proposal_len >= k + 1
    reached: jax.Array  # int32 [S, P] rounds with proposal_len >= k + 1 and accepted >= k

    @classmethod
    def zeros(cls, slots: int, proposals: int) -> "Counters":
        vec = jnp.zeros((slots,), jnp.int32)
        mat = jnp.zeros((slots, proposals), jnp.int32)
        return cls(vec, vec, vec, vec, mat, mat, mat)


@struct.dataclass
class Trace:
    """Per-round record of each slot's request (R = 0: nothing recorded); round r of a request
    is entry r of its row, valid for r < Counters.rounds."""

    confidence_logits: jax.Array  # float32 [S, R, P] raw z_k of the verified block (0: no head)
    proposal_len: jax.Array  # int32 [S, R] draft tokens the scheduler sent to the verifier
    num_accepted: jax.Array  # int32 [S, R] draft tokens the verifier accepted

    @classmethod
    def zeros(cls, slots: int, rounds: int, proposals: int) -> "Trace":
        ints = jnp.zeros((slots, rounds), jnp.int32)
        return cls(jnp.zeros((slots, rounds, proposals), jnp.float32), ints, ints)


@struct.dataclass
class Slots:
    """The state of every slot (leading dim S; free slots hold stale values)."""

    active: jax.Array  # bool [S] a request is generating in the slot
    anchor: jax.Array  # int32 [S] last committed token
    anchor_pos: jax.Array  # int32 [S] its position (= committed cache length)
    generated: jax.Array  # int32 [S] tokens emitted so far
    max_new: jax.Array  # int32 [S] the request's max_new_tokens
    output: jax.Array  # int32 [S, M] tokens emitted so far (entries past `generated`: stale)
    block_tokens: jax.Array  # int32 [S, P] drafted proposal
    block_probs: jax.Array  # float32 [S, P, V] the rows the proposals were drawn from ([S, P, V']
    #                         over a draft vocabulary's tokens: block_sampler.full_vocab_probs)
    confidence: jax.Array  # float32 [S, P] per-step confidences c_k of the block
    confidence_logits: jax.Array  # float32 [S, P] their raw z_k (0 without a confidence head)
    history: jax.Array  # float32 [2, S, P] confidences of the blocks verified two rounds and one
    #                     round ago (NO_HISTORY before the request had them)
    sampling: SamplingParams  # per-slot temperature / top_p / top_k, each [S]
    counters: Counters
    trace: Trace
    keys: jax.Array  # PRNG key per slot [S]: its request's own random stream

    @classmethod
    def empty(cls, slots: int, proposals: int, vocab: int, output_len: int, key: jax.Array,
              record_rounds: int = 0) -> "Slots":
        """vocab: the width of the draft rows, V or a draft vocabulary's V'."""
        zeros = jnp.zeros((slots,), jnp.int32)
        conf = jnp.zeros((slots, proposals), jnp.float32)
        return cls(jnp.zeros((slots,), bool), zeros, zeros, zeros, zeros,
                   jnp.zeros((slots, output_len), jnp.int32),
                   jnp.zeros((slots, proposals), jnp.int32),
                   jnp.zeros((slots, proposals, vocab), jnp.float32), conf, conf,
                   jnp.stack([conf, conf]), SamplingParams.broadcast(slots),
                   Counters.zeros(slots, proposals), Trace.zeros(slots, record_rounds, proposals),
                   jax.random.split(key, slots))


@struct.dataclass
class Caches:
    target: KVCache  # keys [L, S, K, D, N] (on a CPU; else like values), values [L, S, K, N, D]
    drafter: KVCache | None  # the same layout over L_draft layers; None without a drafter


def laid_out(slots: Slots, caches: Caches) -> tuple[Slots, Caches]:
    """The engine state's layout under a mesh (inside jit; a no-op without a mesh): slot state
    replicated, cache rows over the data axes and kv heads over the tensor axis. Every program
    returns its state so, so each program receives the shardings it was compiled for."""
    slots = jax.tree.map(lambda x: sharding.constrain(x, (None,) * x.ndim), slots)
    drafter = None if caches.drafter is None else caches.drafter.constrain()
    return slots, Caches(caches.target.constrain(), drafter)


@struct.dataclass
class Admissions:
    """A requests joining slots ``slot`` in one prefill, their prompts laid out flat.

    Rows past the real requests are padding: slot S (every write dropped), length 1."""

    slot: jax.Array  # int32 [A]
    length: jax.Array  # int32 [A] prompt lengths (>= 1)
    tokens: jax.Array  # int32 [T] the prompts one after another, then padding
    rows: jax.Array  # int32 [T] admission row of each token (A: padding)
    cols: jax.Array  # int32 [T] position of each token in its prompt
    max_new: jax.Array  # int32 [A] max_new_tokens (>= 1)
    sampling: SamplingParams  # each [A]
    seeds: jax.Array  # int32 [A, 3] each request's PRNG key, as (kind, a, b) (:func:`request_keys`)


def request_keys(seeds: jax.Array) -> jax.Array:
    """A PRNG key per request from int32 [A, 3] (kind, a, b): fold_in(fold_in(key(kind), a), b).

    The engine writes kind 0 with (its seed, the request id) and kind 1 with the two 32-bit
    halves of a request's own seed, so that a seeded request draws the same stream whenever it
    runs and whatever runs beside it."""
    def one(seed):
        return jax.random.fold_in(jax.random.fold_in(jax.random.key(seed[0]), seed[1]), seed[2])
    return jax.vmap(one)(seeds)


class RoundOutput(NamedTuple):
    finished: jax.Array  # bool [S] the slot's request ended this round
    verified_tokens: jax.Array  # int32: sum over active slots of 1 + proposal_len
    bucket: jax.Array  # int32: index of the token bucket the verify forward ran with


def flat_layout(proposal_len: jax.Array, active: jax.Array, size: int):
    """The marker tensor: where each of ``size`` flat tokens comes from.

    Slot s contributes 1 + proposal_len[s] tokens (its anchor and verified drafts) when active,
    laid out in slot order.

    Returns:
      rows: int32 [size] slot of each token; S for padding past the last token.
      cols: int32 [size] column within the slot (0 = anchor); 0 for padding.
      total: int32, the number of real tokens.
    """
    num_slots = proposal_len.shape[0]
    counts = jnp.where(active, proposal_len + 1, 0)
    ends = jnp.cumsum(counts)
    t = jnp.arange(size)
    rows = jnp.searchsorted(ends, t, side="right").astype(jnp.int32)
    safe = jnp.minimum(rows, num_slots - 1)
    cols = jnp.where(rows < num_slots, t - (ends[safe] - counts[safe]), 0).astype(jnp.int32)
    return rows, cols, ends[-1].astype(jnp.int32)


class Emission(NamedTuple):
    """What one verified round adds to each slot's output."""

    tokens: jax.Array  # int32 [S, Q]: the accepted drafts, then the corrected / bonus token
    count: jax.Array  # int32 [S] of them emitted: cut after the first EOS and at the limit
    finished: jax.Array  # bool [S] active slots that ended (EOS emitted or limit reached)
    tau: jax.Array  # int32 [S] accepted + 1, or up to an accepted EOS; 0 for inactive slots


def emit_round(draft_tokens: jax.Array, verdict: rejection.VerifyResult, active: jax.Array,
               generated: jax.Array, max_new: jax.Array, eos_ids: jax.Array) -> Emission:
    """The tokens a round emits per slot.

    Args:
      draft_tokens: int32 [S, P] the verified block; verdict: its rejection-sampling verdict.
      active: bool [S]; generated: int32 [S] tokens emitted so far; max_new: int32 [S] limits.
      eos_ids: int32 [E].
    """
    batch, width = draft_tokens.shape[0], draft_tokens.shape[1] + 1
    accepted = verdict.num_accepted
    tokens = jnp.concatenate([draft_tokens, jnp.zeros((batch, 1), jnp.int32)], axis=1)
    tokens = tokens.at[jnp.arange(batch), accepted].set(verdict.next_token)
    index = jnp.arange(width)
    eos_at = jnp.where(is_eos(tokens, eos_ids) & (index <= accepted[:, None]), index, width)
    first_eos = jnp.min(eos_at, axis=1)
    count = jnp.minimum(jnp.minimum(accepted, first_eos) + 1, max_new - generated)
    count = jnp.where(active, count, 0)
    finished = active & ((first_eos < count) | (generated + count >= max_new))
    ended_by_eos = first_eos < accepted  # an accepted draft token was EOS
    tau = jnp.where(active, jnp.where(ended_by_eos, first_eos + 1, accepted + 1), 0)
    return Emission(tokens, count, finished, tau)


def _draft(target, drafter, *, taps, positions, cache, anchor, anchor_pos, key,
           sampling: SamplingParams, temperatures, draft_vocab):
    """The next block of every row: (draft cache, tokens [b, P], probs [b, P, V or V'],
    confidences [b, P], raw confidence logits [b, P]); ``draft_vocab`` as in ``block_sampler``."""
    drafted = drafter.draft(target, ctx_taps=taps, ctx_positions=positions, cache=cache,
                            anchor_tokens=anchor, anchor_positions=anchor_pos)
    block = sample_draft(drafter, target, hidden=drafted.hidden, anchor_tokens=anchor, key=key,
                         temperature=sampling.temperature, top_p=sampling.top_p,
                         top_k=sampling.top_k, draft_vocab=draft_vocab)
    raw = (jnp.zeros(block.tokens.shape, jnp.float32) if block.confidence is None
           else block.confidence.astype(jnp.float32))
    return drafted.cache, block.tokens, block.probs, block_confidences(block, temperatures), raw


def prefill(target, drafter, slots: Slots, caches: Caches, admissions: Admissions,
            eos_ids: jax.Array, temperatures: jax.Array, draft_vocab: DraftVocab | None, *,
            width: int) -> tuple[Slots, Caches, jax.Array]:
    """Admits A requests: target K/V and taps of their prompts, first token, first draft.

    The slots' cache rows are overwritten from position 0 (nothing of a previous request is
    visible) and their counters, output and history start afresh.

    Args:
      target: the target ``Decoder``; drafter: its ``DSparkModel`` or None.
      temperatures: float32 [P] the drafter's STS temperatures (ones: uncalibrated).
      draft_vocab: the drafter's ``block_sampler.DraftVocab``, or None (the whole vocabulary).
      width: W, the static prompt width of the admission grid (>= every prompt length).

    Returns:
      (slots, caches, done bool [A]: the request already ended with its first token).
    """
    a = admissions
    num_admitted = a.slot.shape[0]
    cfg = target.config
    taps = () if drafter is None else tuple(drafter.config.target_layer_ids)
    no_history = KVCache.for_model(cfg, num_admitted, 0, caches.target.dtype,
                                   caches.target.transposed_keys)
    o = ragged_forward(target, a.tokens, a.cols, a.rows, a.cols, jnp.zeros_like(a.length),
                       no_history, width=width, tap_layer_ids=taps)
    grid_positions = jnp.broadcast_to(jnp.arange(width), (num_admitted, width))
    t_cache = caches.target.write_prefix(o.new_k, o.new_v, a.slot)

    last = jnp.cumsum(a.length) - 1  # flat index of each prompt's last token
    k_first, k_draft, k_rounds = split_key(request_keys(a.seeds), 3)
    first, _ = sample(k_first, target.logits(o.hidden[last]), a.sampling.temperature,
                      a.sampling.top_p, a.sampling.top_k)
    done = is_eos(first, eos_ids) | (a.max_new <= 1)

    put = lambda full, rows: full.at[a.slot].set(rows, mode="drop")  # noqa: E731
    d_cache, block = caches.drafter, {}
    if drafter is not None:
        fresh = drafter.init_cache(num_admitted, caches.drafter.num_slots, caches.drafter.dtype,
                                   caches.drafter.transposed_keys)
        new_cache, tokens, probs, conf, raw = _draft(
            target, drafter, taps=to_grid(o.taps, a.rows, a.cols, num_admitted, width),
            positions=grid_positions, cache=fresh, anchor=first, anchor_pos=a.length,
            key=k_draft, sampling=a.sampling, temperatures=temperatures, draft_vocab=draft_vocab)
        d_cache = caches.drafter.set_rows(new_cache, a.slot)
        block = dict(block_tokens=put(slots.block_tokens, tokens),
                     block_probs=put(slots.block_probs, probs),
                     confidence=put(slots.confidence, conf),
                     confidence_logits=put(slots.confidence_logits, raw))
    s = slots.sampling
    zero_rows = lambda x: put(x, jnp.zeros((num_admitted,) + x.shape[1:], x.dtype))  # noqa: E731
    slots = slots.replace(
        active=put(slots.active, ~done), anchor=put(slots.anchor, first),
        anchor_pos=put(slots.anchor_pos, a.length),
        generated=put(slots.generated, jnp.ones_like(a.length)), max_new=put(slots.max_new, a.max_new),
        output=zero_rows(slots.output).at[a.slot, 0].set(first, mode="drop"),
        history=slots.history.at[:, a.slot].set(NO_HISTORY, mode="drop"),
        sampling=SamplingParams(put(s.temperature, a.sampling.temperature),
                                put(s.top_p, a.sampling.top_p), put(s.top_k, a.sampling.top_k)),
        counters=jax.tree.map(zero_rows, slots.counters), keys=put(slots.keys, k_rounds), **block)
    return *laid_out(slots, Caches(t_cache, d_cache)), done


def verify_round(target, drafter, slots: Slots, caches: Caches, proposal_len: jax.Array,
                 eos_ids: jax.Array, temperatures: jax.Array, draft_vocab: DraftVocab | None, *,
                 buckets: tuple[int, ...], view: int | None = None
                 ) -> tuple[Slots, Caches, RoundOutput]:
    """One verify + emit + draft round over every slot.

    Args:
      target: the target ``Decoder``; drafter: its ``DSparkModel`` or None (autoregressive).
      proposal_len: int32 [S] drafts each slot verifies (0 for free slots; the scheduler's choice).
      temperatures: float32 [P] the drafter's STS temperatures.
      draft_vocab: the drafter's ``block_sampler.DraftVocab``, or None (the whole vocabulary).
      buckets: static sorted flat token counts of the verify forward, the last one S * Q.
      view: static cache slots the verify attention reads (``ragged_forward``); every active
        slot's anchor_pos must be at most ``view`` (None: all).
    """
    num_slots, proposals = slots.block_tokens.shape
    width = proposals + 1
    assert buckets[-1] == num_slots * width, (buckets, num_slots, width)
    taps = () if drafter is None else tuple(drafter.config.target_layer_ids)
    active, anchor, anchor_pos, sampling = slots.active, slots.anchor, slots.anchor_pos, slots.sampling
    proposal_len = jnp.where(active, proposal_len, 0)

    rows, cols, total = flat_layout(proposal_len, active, buckets[-1])
    safe_rows = jnp.minimum(rows, num_slots - 1)
    verify_tokens = jnp.concatenate([anchor[:, None], slots.block_tokens], axis=1)  # [S, Q]
    tokens = verify_tokens[safe_rows, cols]
    positions = anchor_pos[safe_rows] + cols

    keys, k_verify, k_draft = split_key(slots.keys, 3)
    all_greedy = jnp.all((sampling.temperature <= GREEDY_TEMPERATURE) | ~active)

    def verify_branch(size):
        """Target forward over the first ``size`` flat tokens and the verdict of every slot; the
        verified rows come back in the [S, Q] grid. The top bucket (S * Q tokens) runs the whole
        grid instead, row-major (unverified columns and free slots are padding), so its grid is
        a reshape. When every active slot is greedy the verdict comes from the target's argmax
        alone (``rejection.greedy_verify``)."""
        dense = size == num_slots * width

        def run(t_cache, tokens, positions, rows, cols, sampling, proposal_len):
            if dense:
                tokens = verify_tokens.reshape(-1)
                positions = (anchor_pos[:, None] + jnp.arange(width)).reshape(-1)
            o = ragged_forward(target, tokens[:size], positions[:size], rows[:size], cols[:size],
                               anchor_pos, t_cache, width=width, tap_layer_ids=taps, dense=dense,
                               view=view)
            logits = target.logits(o.hidden)  # [size, V]
            at = (rows[:size], cols[:size])

            def to_slots(x):  # [size, ...] -> [S, Q, ...]
                if dense:
                    return x.reshape((num_slots, width) + x.shape[1:])
                return to_grid(x, *at, num_slots, width)

            def sampled():
                if proposals == 0:  # autoregressive: the next token is drawn from the target row
                    nxt, _ = sample(k_verify, to_slots(logits)[:, 0], sampling.temperature,
                                    sampling.top_p, sampling.top_k)
                    return rejection.VerifyResult(jnp.zeros_like(nxt), nxt,
                                                  jnp.zeros((num_slots, 0), bool))
                row_of = (jnp.arange(size) // width if dense
                          else jnp.minimum(rows[:size], num_slots - 1))
                probs = sampling_probs(logits, sampling.temperature[row_of],
                                       sampling.top_p[row_of], sampling.top_k[row_of])
                draft_probs = full_vocab_probs(slots.block_probs, draft_vocab, logits.shape[-1])
                return rejection.rejection_sample(k_verify, slots.block_tokens, draft_probs,
                                                  to_slots(probs), proposal_len)

            def greedy():
                return rejection.greedy_verify(slots.block_tokens, to_slots(argmax(logits)),
                                               proposal_len)

            verdict = jax.lax.cond(all_greedy, greedy, sampled)
            tap_grid = None if o.taps is None else to_slots(o.taps)
            return verdict, tap_grid, o.new_k, o.new_v
        return run

    bucket = jnp.searchsorted(jnp.asarray(buckets), total).astype(jnp.int32)
    verdict, new_taps, new_k, new_v = jax.lax.switch(
        bucket, [verify_branch(size) for size in buckets], caches.target, tokens, positions, rows,
        cols, sampling, proposal_len)
    index = jnp.arange(width)
    verified = active[:, None] & (index[None, :] <= proposal_len[:, None])  # [S, Q]
    written = jnp.where(verified, anchor_pos[:, None] + index, caches.target.num_slots)  # else dropped
    t_cache = caches.target.write(new_k, new_v, written)
    accepted = jnp.where(active, verdict.num_accepted, 0)

    # Emit accepted + next token, cut after the first EOS and at the request's max_new_tokens.
    em = emit_round(slots.block_tokens, verdict, active, slots.generated, slots.max_new, eos_ids)
    out_at = jnp.where(index[None, :] < em.count[:, None], slots.generated[:, None] + index,
                       slots.output.shape[1])
    output = slots.output.at[jnp.arange(num_slots)[:, None], out_at].set(em.tokens, mode="drop")

    # Counters and the trace, over the slots active this round.
    act = active.astype(jnp.int32)
    ks = jnp.arange(1, proposals + 1)
    c = slots.counters
    counters = Counters(
        rounds=c.rounds + act, tau_sum=c.tau_sum + em.tau, accepted=c.accepted + accepted,
        proposal_len_sum=c.proposal_len_sum + proposal_len,
        accepted_ge=c.accepted_ge + act[:, None] * (accepted[:, None] >= ks),
        proposal_len_ge=c.proposal_len_ge + act[:, None] * (proposal_len[:, None] >= ks),
        reached=c.reached + act[:, None] * ((proposal_len[:, None] >= ks)
                                            & (accepted[:, None] >= ks - 1)))
    t = slots.trace
    at_round = (jnp.arange(num_slots), jnp.where(active, c.rounds, t.proposal_len.shape[1]))
    trace = Trace(t.confidence_logits.at[at_round].set(slots.confidence_logits, mode="drop"),
                  t.proposal_len.at[at_round].set(proposal_len, mode="drop"),
                  t.num_accepted.at[at_round].set(accepted, mode="drop"))

    # Commit: new anchor after the accepted prefix; draft the next block from the verified taps.
    new_anchor = jnp.where(active, verdict.next_token, anchor)
    new_pos = jnp.where(active, anchor_pos + accepted + 1, anchor_pos)
    d_cache, block = caches.drafter, {}
    if drafter is not None:
        d_cache, tokens, probs, conf, raw = _draft(
            target, drafter, taps=new_taps, positions=written, cache=caches.drafter,
            anchor=new_anchor, anchor_pos=new_pos, key=k_draft, sampling=sampling,
            temperatures=temperatures, draft_vocab=draft_vocab)
        block = dict(block_tokens=tokens, block_probs=probs, confidence=conf,
                     confidence_logits=raw)
    history = jnp.stack([slots.history[1], slots.confidence])  # verified now; lagged in 2 rounds
    slots = slots.replace(active=active & ~em.finished, anchor=new_anchor, anchor_pos=new_pos,
                          generated=slots.generated + em.count, output=output, history=history,
                          counters=counters, trace=trace, keys=keys, **block)
    return *laid_out(slots, Caches(t_cache, d_cache)), RoundOutput(em.finished, total, bucket)
