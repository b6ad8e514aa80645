"""Continuous batching as pure functions: admitting a request into a slot, and one decode step.

The engine keeps S slots. Each slot holds one request's state in :class:`Slots` and one row of
each KV cache (:class:`Caches`); a request joins by :func:`admit` (prefill into a free slot) and
leaves when :func:`decode_step` reports it finished. Both functions take and return explicit
pytrees and are jitted with the model graphdefs static, so one step program serves every mix
of requests.

Per-slot invariants are those of ``decoding/speculative.py``: ``anchor`` is the last committed
token, at ``anchor_pos``; both caches hold every committed position < anchor_pos of the slot's
row (slot == position, so stale entries beyond are invisible and rollback is free); ``block``
is the drafted proposal for positions anchor_pos + 1 .. anchor_pos + P.

One decode step:
  1. the verification policy picks n_s drafts per slot (0 for free slots);
  2. the verified tokens [anchor, x_1 .. x_{n_s}] of all slots are laid out flat (the marker
     tensor: per-token slot ids, columns, positions; :func:`flat_layout`), cut to the smallest
     token bucket >= sum_s (1 + n_s), and the target runs once over them
     (:func:`dspark_jax.models.ragged.ragged_forward`, one ``lax.switch`` branch per bucket);
  3. rejection sampling (``decoding/rejection.py``) accepts a prefix of each slot and draws the
     corrected / bonus token (from the argmax alone when every active slot is greedy); emitted
     tokens are cut at EOS and at the request's limit;
  4. the drafter consumes the taps of each slot's verified inputs and drafts the next block.

Shapes: S slots, P proposals per block, Q = P + 1, N cache slots per row, V vocabulary,
W prompt bucket, T flat verify tokens (a bucket), m*d tap width.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx, struct

from dspark_jax import sharding
from dspark_jax.decoding import rejection
from dspark_jax.decoding.autoregressive import SamplingParams, is_eos
from dspark_jax.decoding.block_sampler import block_confidences, sample_draft
from dspark_jax.decoding.sampling import GREEDY_TEMPERATURE, argmax, sample, sampling_probs
from dspark_jax.decoding.speculative import emit_round
from dspark_jax.decoding.verification import policy_lengths
from dspark_jax.models.kv_cache import KVCache
from dspark_jax.models.ragged import ragged_forward


@struct.dataclass
class Slots:
    """The state of every slot (all leading dims S; free slots hold stale values)."""

    active: jax.Array  # bool [S] a request is generating in the slot
    anchor: jax.Array  # int32 [S] last committed token
    anchor_pos: jax.Array  # int32 [S] its position (= committed cache length)
    generated: jax.Array  # int32 [S] tokens emitted so far
    max_new: jax.Array  # int32 [S] the request's max_new_tokens
    block_tokens: jax.Array  # int32 [S, P] drafted proposal
    block_probs: jax.Array  # float32 [S, P, V] the rows the proposals were drawn from
    confidence: jax.Array  # float32 [S, P] per-step confidences c_k of the block
    history: jax.Array  # float32 [2, S, P] confidences of the blocks verified two steps and one
    #                     step ago (0 before the request had them: it adds nothing to the capacity)
    sampling: SamplingParams  # per-slot temperature / top_p / top_k, each [S]
    key: jax.Array  # PRNG key of the decode steps

    @classmethod
    def empty(cls, slots: int, proposals: int, vocab: int, key: jax.Array) -> "Slots":
        zeros = jnp.zeros((slots,), jnp.int32)
        conf = jnp.zeros((slots, proposals), jnp.float32)
        return cls(jnp.zeros((slots,), bool), zeros, zeros, zeros, zeros,
                   jnp.zeros((slots, proposals), jnp.int32),
                   jnp.zeros((slots, proposals, vocab), jnp.float32), conf, jnp.stack([conf, conf]),
                   SamplingParams.broadcast(slots), key)


@struct.dataclass
class Caches:
    target: KVCache  # k/v [L, S, K, N, D]
    drafter: KVCache  # k/v [L_draft, S, K, N, D]


def laid_out(slots: Slots, caches: Caches) -> tuple[Slots, Caches]:
    """The engine state's layout under a mesh (inside jit; a no-op without a mesh): slot state
    replicated, cache rows over the data axes and kv heads over the tensor axis. The engine
    creates its state laid out so and every program returns it so, so each program receives
    the shardings it was compiled for."""
    slots = jax.tree.map(lambda x: sharding.constrain(x, (None,) * x.ndim), slots)
    return slots, Caches(caches.target.constrain(), caches.drafter.constrain())


@struct.dataclass
class Admission:
    """One request joining slot ``slot`` (all scalars except the padded prompt)."""

    slot: jax.Array  # int32
    tokens: jax.Array  # int32 [W] prompt, right-padded
    length: jax.Array  # int32 prompt length (>= 1)
    max_new: jax.Array  # int32 max_new_tokens (>= 1)
    temperature: jax.Array  # float32
    top_p: jax.Array  # float32
    top_k: jax.Array  # int32
    key: jax.Array  # the engine's PRNG key; the request's is fold_in(key, request_id)
    request_id: jax.Array  # int32
    confidence_temperatures: jax.Array  # float32 [P] the drafter's STS temperatures (1: none)


class StepOutput(NamedTuple):
    emitted: jax.Array  # int32 [S, Q]; the first num_emitted of a slot are its new tokens
    num_emitted: jax.Array  # int32 [S]
    finished: jax.Array  # bool [S] the slot's request ended this step
    accepted: jax.Array  # int32 [S] draft tokens accepted
    num_draft: jax.Array  # int32 [S] draft tokens verified (the slot's budget)
    tau: jax.Array  # int32 [S] accepted + 1 (accepted only when an accepted EOS ends the round)
    verified_tokens: jax.Array  # int32: sum over active slots of 1 + num_draft
    bucket: jax.Array  # int32: index of the token bucket the verify forward ran with


def flat_layout(lengths: jax.Array, active: jax.Array, size: int):
    """The marker tensor: where each of ``size`` flat tokens comes from.

    Slot s contributes 1 + lengths[s] tokens (its anchor and verified drafts) when active,
    laid out in slot order.

    Returns:
      rows: int32 [size] slot of each token; S for padding past the last token.
      cols: int32 [size] column within the slot (0 = anchor); 0 for padding.
      total: int32, the number of real tokens.
    """
    num_slots = lengths.shape[0]
    counts = jnp.where(active, lengths + 1, 0)
    ends = jnp.cumsum(counts)
    t = jnp.arange(size)
    rows = jnp.searchsorted(ends, t, side="right").astype(jnp.int32)
    safe = jnp.minimum(rows, num_slots - 1)
    cols = jnp.where(rows < num_slots, t - (ends[safe] - counts[safe]), 0).astype(jnp.int32)
    return rows, cols, ends[-1].astype(jnp.int32)


def _sample_block(drafter, target, hidden, anchor, key, sampling: SamplingParams):
    return sample_draft(drafter, target, hidden=hidden, anchor_tokens=anchor, key=key,
                        temperature=sampling.temperature, top_p=sampling.top_p,
                        top_k=sampling.top_k)


def admit(target_graphdef: nnx.GraphDef, target_state: nnx.State, drafter_graphdef: nnx.GraphDef,
          drafter_state: nnx.State, slots: Slots, caches: Caches, request: Admission,
          eos_ids: jax.Array) -> tuple[Slots, Caches, jax.Array, jax.Array]:
    """Prefills ``request`` into its slot: target K/V and taps of the prompt, first token, first
    draft. The slot's cache rows are overwritten from position 0 (no trace of the previous
    request is visible).

    Returns:
      (slots, caches, first token int32, done bool: the request already ended).
    """
    target = nnx.merge(target_graphdef, target_state)
    drafter = nnx.merge(drafter_graphdef, drafter_state)
    cfg = target.cfg
    width = request.tokens.shape[0]
    slot = request.slot
    positions = jnp.arange(width)[None]
    no_history = KVCache.zeros(cfg.num_hidden_layers, 1, 0, cfg.num_key_value_heads, cfg.head_dim,
                               caches.target.k.dtype)
    out = target(request.tokens[None], positions, cache=no_history,
                 tap_layer_ids=tuple(drafter.cfg.target_layer_ids), write_cache=False)
    t_cache = caches.target.place_row(*out.new_kv, slot)

    params = SamplingParams(request.temperature[None], request.top_p[None], request.top_k[None])
    k_first, k_draft = jax.random.split(jax.random.fold_in(request.key, request.request_id))
    first, _ = sample(k_first, target.logits(out.hidden[:, request.length - 1]),
                      params.temperature, params.top_p, params.top_k)
    row = drafter.init_cache(1, caches.drafter.num_slots, caches.drafter.k.dtype)
    drafted = drafter.draft(target, ctx_taps=out.taps, ctx_positions=positions, cache=row,
                            anchor_tokens=first, anchor_positions=request.length[None])
    corner = (0, slot, 0, 0, 0)  # the row's whole draft cache
    d_cache = KVCache(*(jax.lax.dynamic_update_slice(full, new, corner) for full, new in
                        zip((caches.drafter.k, caches.drafter.v),
                            (drafted.cache.k, drafted.cache.v))))
    block = _sample_block(drafter, target, drafted.hidden, first, k_draft, params)
    conf = block_confidences(block, request.confidence_temperatures)[0]
    done = is_eos(first[0], eos_ids) | (request.max_new <= 1)
    s = slots.sampling
    slots = slots.replace(
        active=slots.active.at[slot].set(~done), anchor=slots.anchor.at[slot].set(first[0]),
        anchor_pos=slots.anchor_pos.at[slot].set(request.length),
        generated=slots.generated.at[slot].set(1),
        max_new=slots.max_new.at[slot].set(request.max_new),
        block_tokens=slots.block_tokens.at[slot].set(block.tokens[0]),
        block_probs=slots.block_probs.at[slot].set(block.probs[0]),
        confidence=slots.confidence.at[slot].set(conf), history=slots.history.at[:, slot].set(0.0),
        sampling=SamplingParams(s.temperature.at[slot].set(request.temperature),
                                s.top_p.at[slot].set(request.top_p),
                                s.top_k.at[slot].set(request.top_k)))
    return *laid_out(slots, Caches(t_cache, d_cache)), first[0], done


def decode_step(target_graphdef: nnx.GraphDef, target_state: nnx.State,
                drafter_graphdef: nnx.GraphDef, drafter_state: nnx.State, slots: Slots,
                caches: Caches, eos_ids: jax.Array, policy_params: dict, *,
                buckets: tuple[int, ...], policy) -> tuple[Slots, Caches, StepOutput]:
    """One verify + commit + draft step over every slot (jit with the keyword arguments static).

    Args:
      policy_params: traced parameters of ``policy`` (``verification.default_params`` with
        batch S).
      buckets: sorted flat token counts of the verify forward, the last one S * (P + 1).
      policy: a verification policy name or function (``decoding/verification.py``).
    """
    target = nnx.merge(target_graphdef, target_state)
    drafter = nnx.merge(drafter_graphdef, drafter_state)
    num_slots, proposals = slots.block_tokens.shape
    width = proposals + 1
    assert buckets[-1] == num_slots * width, (buckets, num_slots, width)
    taps = tuple(drafter.cfg.target_layer_ids)
    active, anchor, anchor_pos = slots.active, slots.anchor, slots.anchor_pos
    sampling = slots.sampling

    num_draft = policy_lengths(policy, slots.confidence, slots.history[0], active, policy_params)
    rows, cols, total = flat_layout(num_draft, active, buckets[-1])
    safe_rows = jnp.minimum(rows, num_slots - 1)
    verify_tokens = jnp.concatenate([anchor[:, None], slots.block_tokens], axis=1)  # [S, Q]
    tokens = verify_tokens[safe_rows, cols]
    positions = anchor_pos[safe_rows] + cols

    key, k_verify, k_draft = jax.random.split(slots.key, 3)
    all_greedy = jnp.all((sampling.temperature <= GREEDY_TEMPERATURE) | ~active)

    def verify_branch(size):
        """Target forward over the first ``size`` flat tokens and the verdict of every slot; the
        verified rows come back in the [S, Q] grid. When every active slot is greedy the verdict
        comes from the target's argmax alone (``rejection.greedy_verify``), without the
        probability rows."""
        def run(t_cache, tokens, positions, rows, cols, sampling, num_draft):
            o = ragged_forward(target, tokens[:size], positions[:size], rows[:size], cols[:size],
                               anchor_pos, t_cache, width=width, tap_layer_ids=taps)
            logits = target.logits(o.hidden)  # [size, V]
            at = (rows[:size], cols[:size])

            def sampled():
                row_of = jnp.minimum(rows[:size], num_slots - 1)
                probs = sampling_probs(logits, sampling.temperature[row_of],
                                       sampling.top_p[row_of], sampling.top_k[row_of])
                grid = jnp.zeros((num_slots, width) + probs.shape[1:], probs.dtype)
                grid = grid.at[at].set(probs, mode="drop")
                return rejection.rejection_sample(k_verify, slots.block_tokens, slots.block_probs,
                                                  grid, num_draft)

            def greedy():
                grid = jnp.zeros((num_slots, width), jnp.int32).at[at].set(argmax(logits), mode="drop")
                return rejection.greedy_verify(slots.block_tokens, grid, num_draft)

            verdict = jax.lax.cond(all_greedy, greedy, sampled)
            tap_grid = jnp.zeros((num_slots, width) + o.taps.shape[1:], o.taps.dtype)
            tap_grid = tap_grid.at[at].set(o.taps, mode="drop")
            return verdict, tap_grid, o.new_k, o.new_v
        return run

    bucket = jnp.searchsorted(jnp.asarray(buckets), total).astype(jnp.int32)
    verdict, new_taps, new_k, new_v = jax.lax.switch(
        bucket, [verify_branch(size) for size in buckets], caches.target, tokens, positions, rows,
        cols, sampling, num_draft)
    index = jnp.arange(width)
    verified = active[:, None] & (index[None, :] <= num_draft[:, None])  # [S, Q]
    num_cache_slots = caches.target.num_slots
    written = jnp.where(verified, anchor_pos[:, None] + index, num_cache_slots)  # else dropped
    t_cache = caches.target.write(new_k, new_v, written)

    accepted = verdict.num_accepted

    # Emit accepted + next token, cut after the first EOS and at the request's max_new_tokens.
    em = emit_round(slots.block_tokens, verdict, active, slots.generated, slots.max_new, eos_ids)
    generated = slots.generated + em.count

    # Commit: new anchor after the accepted prefix; draft the next block from the verified taps.
    new_anchor = jnp.where(active, verdict.next_token, anchor)
    new_pos = jnp.where(active, anchor_pos + accepted + 1, anchor_pos)
    drafted = drafter.draft(target, ctx_taps=new_taps, ctx_positions=written, cache=caches.drafter,
                            anchor_tokens=new_anchor, anchor_positions=new_pos)
    block = _sample_block(drafter, target, drafted.hidden, new_anchor, k_draft, sampling)
    conf = block_confidences(block, policy_params["confidence_temperatures"])
    history = jnp.stack([slots.history[1], slots.confidence])  # verified now; lagged in 2 steps
    slots = slots.replace(active=active & ~em.finished, anchor=new_anchor, anchor_pos=new_pos,
                          generated=generated, block_tokens=block.tokens, block_probs=block.probs,
                          confidence=conf, history=history, key=key)
    out = StepOutput(em.tokens, em.count, em.finished, jnp.where(active, accepted, 0), num_draft,
                     em.tau, total, bucket)
    return *laid_out(slots, Caches(t_cache, drafted.cache)), out
