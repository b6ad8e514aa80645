"""Speculative decoding of a batch inside one jitted ``lax.while_loop`` (DSPARK_SPEC.md section 7).

Invariants (per row): ``anchor`` is the last committed token, at position ``anchor_pos``; the
target and draft caches hold every committed position < anchor_pos (slot == position, stale
slots beyond are invisible and overwritten later, so rollback is free); ``block`` is the
drafted proposal for positions anchor_pos + 1 ... anchor_pos + P.

One round:
  1. the verification policy picks how many drafts each row verifies (n_b <= P);
  2. the target runs on [anchor, x_1 .. x_P] truncated to the smallest bucket T >= max n_b + 1
     (``lax.switch`` over the buckets: one program, one branch per bucket) and writes its K/V;
  3. rejection sampling accepts a prefix of each row and draws the corrected / bonus token;
  4. the emitted tokens (accepted + 1, cut at EOS / max_new_tokens) are appended to the output;
  5. the drafter consumes the taps of the verified inputs [anchor, accepted] and drafts the
     next block from the new anchor.

Prompts are right-padded; positions are per row, so mixed prompt lengths decode exactly as
alone. Shapes: b rows, W prompt width, P proposals per block, T verify bucket, V vocabulary.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from dspark_jax.decoding import rejection
from dspark_jax.decoding.autoregressive import SamplingParams, is_eos
from dspark_jax.decoding.block_sampler import block_confidences, sample_draft
from dspark_jax.decoding.sampling import sample
from dspark_jax.decoding.verification import policy_lengths
from dspark_jax.models.kv_cache import KVCache


class SpecStats(NamedTuple):
    """Per-row counters, accumulated over the rounds a row was active."""

    rounds: jax.Array  # int32 [b]
    tau_sum: jax.Array  # int32 [b]: accepted + 1 per round (accepted only when EOS ends it)
    accepted: jax.Array  # int32 [b]: draft tokens accepted by the verifier
    proposed: jax.Array  # int32 [b]: draft tokens verified (sum of n)
    accepted_ge: jax.Array  # int32 [b, P]: rounds with accepted >= k + 1
    proposed_ge: jax.Array  # int32 [b, P]: rounds with n >= k + 1
    reached: jax.Array  # int32 [b, P]: rounds with n >= k + 1 and accepted >= k


class SpecTrace(NamedTuple):
    """Per-round record of every row (``record=True``), R = max_new_tokens round slots.

    Rounds past ``steps`` and rows inactive in a round have ``active`` False."""

    confidence_logits: jax.Array  # float32 [R, b, P] raw z_k of the verified block (0: no head)
    num_verified: jax.Array  # int32 [R, b] draft tokens the policy sent to the verifier
    num_accepted: jax.Array  # int32 [R, b] draft tokens the verifier accepted
    active: jax.Array  # bool [R, b]


class SpecOutput(NamedTuple):
    tokens: jax.Array  # int32 [b, N + P + 1]; entries past num_generated are padding
    num_generated: jax.Array  # int32 [b], EOS included
    stats: SpecStats
    steps: jax.Array  # int32: rounds of the loop (target verify forwards after prefill)
    trace: SpecTrace | None  # with record=True


def _zero_stats(batch: int, proposals: int) -> SpecStats:
    vec = jnp.zeros((batch,), jnp.int32)
    mat = jnp.zeros((batch, proposals), jnp.int32)
    return SpecStats(vec, vec, vec, vec, mat, mat, mat)


def _confidence_logits(block, batch: int, proposals: int) -> jax.Array:
    if block.confidence is None:
        return jnp.zeros((batch, proposals), jnp.float32)
    return block.confidence.astype(jnp.float32)


class Emission(NamedTuple):
    """What one verified round adds to each row's output."""

    tokens: jax.Array  # int32 [b, P + 1]: the accepted drafts, then the corrected / bonus token
    count: jax.Array  # int32 [b] of them emitted: cut after the first EOS and at the row's limit
    finished: jax.Array  # bool [b] active rows that ended (EOS emitted or limit reached)
    tau: jax.Array  # int32 [b] accepted + 1, or up to an accepted EOS; 0 for inactive rows


def emit_round(draft_tokens: jax.Array, verdict: rejection.VerifyDecision, active: jax.Array,
               generated: jax.Array, max_new: jax.Array | int, eos_ids: jax.Array) -> Emission:
    """The tokens a round emits per row (shared by ``decode`` and the serving step).

    Args:
      draft_tokens: int32 [b, P] the verified block; verdict: its rejection-sampling verdict.
      active: bool [b] rows still generating; generated: int32 [b] tokens emitted so far.
      max_new: the rows' max_new_tokens (scalar or [b]); eos_ids: int32 [E].
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


def decode(target_graphdef: nnx.GraphDef, target_state: nnx.State,
           drafter_graphdef: nnx.GraphDef, drafter_state: nnx.State, prompts: jax.Array,
           prompt_lens: jax.Array, key: jax.Array, params: SamplingParams, eos_ids: jax.Array,
           policy_params: dict, *, max_new_tokens: int, buckets: tuple[int, ...],
           policy, record: bool = False) -> SpecOutput:
    """Speculative decoding (jit with the keyword arguments static).

    Args:
      prompts: int32 [b, W] right-padded; prompt_lens: int32 [b] (>= 1).
      key: PRNG key; params: per-row SamplingParams; eos_ids: int32 [E].
      policy_params: traced parameters of ``policy`` (``verification.default_params``), with
        the confidence temperatures [P] every policy's confidences are computed with.
      buckets: sorted verify token counts, the last one P + 1.
      policy: a verification policy name or function (``verification``).
      record: also return the per-round SpecTrace (confidences and acceptance, for calibration).
    """
    target = nnx.merge(target_graphdef, target_state)
    drafter = nnx.merge(drafter_graphdef, drafter_state)
    batch, width = prompts.shape
    proposals = drafter.cfg.block_size - drafter.first_proposal_slot
    top = buckets[-1]
    assert top == proposals + 1, (buckets, proposals)
    taps = tuple(drafter.cfg.target_layer_ids)
    rows = jnp.arange(batch)
    cfg = target.cfg
    slots = width + max_new_tokens + top
    t_cache = KVCache.zeros(cfg.num_hidden_layers, batch, slots, cfg.num_key_value_heads,
                            cfg.head_dim, target.dtype)
    d_cache = drafter.init_cache(batch, slots)

    def propose(d_cache, ctx_taps, ctx_positions, anchor, anchor_pos, key):
        drafted = drafter.draft(target, ctx_taps=ctx_taps, ctx_positions=ctx_positions,
                                cache=d_cache, anchor_tokens=anchor, anchor_positions=anchor_pos)
        block = sample_draft(drafter, target, hidden=drafted.hidden, anchor_tokens=anchor, key=key,
                             temperature=params.temperature, top_p=params.top_p, top_k=params.top_k)
        return drafted.cache, block

    # Prefill: target over the prompts, first token, first draft from the prompt context.
    positions = jnp.broadcast_to(jnp.arange(width), prompts.shape)
    out = target(prompts, positions, cache=t_cache, tap_layer_ids=taps)
    key, k_first, k_draft = jax.random.split(key, 3)
    first, _ = sample(k_first, target.logits(out.hidden[rows, prompt_lens - 1]),
                      params.temperature, params.top_p, params.top_k)
    d_cache, block = propose(d_cache, out.taps, positions, first, prompt_lens, k_draft)
    temps = policy_params["confidence_temperatures"]
    tokens = jnp.zeros((batch, max_new_tokens + top), jnp.int32).at[:, 0].set(first)
    done = is_eos(first, eos_ids) | (max_new_tokens <= 1)
    # history: confidences of the blocks verified two rounds and one round ago (zeros at first).
    carry = dict(step=jnp.int32(0), t_cache=out.cache, d_cache=d_cache, block=block,
                 history=jnp.zeros((2, batch, proposals), jnp.float32), anchor=first,
                 anchor_pos=prompt_lens, tokens=tokens, count=jnp.ones((batch,), jnp.int32),
                 done=done, key=key, stats=_zero_stats(batch, proposals))
    if record:
        rounds = jnp.zeros((max_new_tokens, batch), jnp.int32)
        carry["trace"] = SpecTrace(jnp.zeros((max_new_tokens, batch, proposals), jnp.float32),
                                   rounds, rounds, jnp.zeros((max_new_tokens, batch), bool))

    def verify_branch(size):
        """Target forward over the first ``size`` verify tokens; outputs padded to ``top``.

        The cache is only read here: the new K/V come back and are written after the switch,
        so no branch returns (and copies) the whole cache."""
        def run(t_cache, verify_tokens, anchor_pos):
            pos = anchor_pos[:, None] + jnp.arange(size)
            o = target(verify_tokens[:, :size], pos, cache=t_cache, tap_layer_ids=taps,
                       write_cache=False)
            pad = [(0, 0), (0, top - size), (0, 0)]
            kv_pad = [(0, 0)] * 2 + [(0, top - size)] + [(0, 0)] * 2
            return (jnp.pad(target.logits(o.hidden), pad), jnp.pad(o.taps, pad),
                    tuple(jnp.pad(x, kv_pad) for x in o.new_kv))
        return run

    branches = [verify_branch(size) for size in buckets]

    def cond(c):
        return ~jnp.all(c["done"]) & (c["step"] < max_new_tokens)

    def body(c):
        active = ~c["done"]
        block, anchor, anchor_pos, count = c["block"], c["anchor"], c["anchor_pos"], c["count"]
        conf = block_confidences(block, temps)
        num_draft = policy_lengths(policy, conf, c["history"][0], active, policy_params,
                                   dense_buckets=buckets)

        # Verify over the smallest bucket holding the longest row.
        bucket = jnp.searchsorted(jnp.asarray(buckets), jnp.max(num_draft) + 1)
        verify_tokens = jnp.concatenate([anchor[:, None], block.tokens], axis=1)
        logits, new_taps, new_kv = jax.lax.switch(bucket, branches, c["t_cache"], verify_tokens,
                                                  anchor_pos)
        t_cache = c["t_cache"].write(*new_kv, anchor_pos[:, None] + jnp.arange(top))
        key, k_verify, k_draft = jax.random.split(c["key"], 3)
        verdict = rejection.verify_logits(k_verify, block.tokens, block.probs, logits, num_draft,
                                          params.temperature, params.top_p, params.top_k)
        accepted = verdict.num_accepted

        # Emit accepted + next token, cut after the first EOS and at max_new_tokens.
        em = emit_round(block.tokens, verdict, active, count, max_new_tokens, eos_ids)
        index = jnp.arange(top)
        tokens = c["tokens"].at[rows[:, None], count[:, None] + index].set(em.tokens, mode="drop")
        new_count = count + em.count
        done = c["done"] | em.finished

        # Statistics over the rows active this round.
        act = active.astype(jnp.int32)
        ks = jnp.arange(1, proposals + 1)
        s = c["stats"]
        stats = SpecStats(
            rounds=s.rounds + act,
            tau_sum=s.tau_sum + em.tau,
            accepted=s.accepted + act * accepted,
            proposed=s.proposed + act * num_draft,
            accepted_ge=s.accepted_ge + act[:, None] * (accepted[:, None] >= ks),
            proposed_ge=s.proposed_ge + act[:, None] * (num_draft[:, None] >= ks),
            reached=s.reached + act[:, None] * ((num_draft[:, None] >= ks)
                                                & (accepted[:, None] >= ks - 1)))

        # Commit: new anchor after the accepted prefix; draft the next block.
        new_anchor = jnp.where(active, verdict.next_token, anchor)
        new_pos = jnp.where(active, anchor_pos + accepted + 1, anchor_pos)
        ctx_positions = anchor_pos[:, None] + index
        d_cache, new_block = propose(c["d_cache"], new_taps, ctx_positions, new_anchor, new_pos,
                                     k_draft)
        out = dict(step=c["step"] + 1, t_cache=t_cache, d_cache=d_cache, block=new_block,
                   history=jnp.stack([c["history"][1], conf]),
                   anchor=new_anchor, anchor_pos=new_pos, tokens=tokens, count=new_count,
                   done=done, key=key, stats=stats)
        if record:
            t, i = c["trace"], c["step"]
            out["trace"] = SpecTrace(
                t.confidence_logits.at[i].set(_confidence_logits(block, batch, proposals)),
                t.num_verified.at[i].set(num_draft), t.num_accepted.at[i].set(accepted),
                t.active.at[i].set(active))
        return out

    final = jax.lax.while_loop(cond, body, carry)
    return SpecOutput(final["tokens"], final["count"], final["stats"], final["step"],
                      final.get("trace"))
