"""``dspark_jax.generate``: prompts in, tokens, text and statistics out.

Strings get the tokenizer's chat template (thinking disabled where the template has the
switch); lists of ints are used as they are. Prompts are right-padded to a power-of-two bucket
so that XLA compiles a bounded number of programs; compiled programs are cached per shape.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from dspark_jax.decoding import autoregressive, speculative, verification
from dspark_jax.target import Target

MIN_PROMPT_BUCKET = 16
LONG_PROMPT_STEP = 1024


@dataclasses.dataclass
class GenerationResult:
    token_ids: list[int]  # generated tokens, EOS included when one was emitted
    text: str  # decoded without special tokens
    stats: dict
    # With record=True: this request's rounds, {"confidence_logits": float32 [r, P],
    # "num_verified": int32 [r], "num_accepted": int32 [r]} (numpy).
    trace: dict | None = None


def prompt_bucket(length: int) -> int:
    """Padded prompt width: the smallest power of two >= length (and >= MIN_PROMPT_BUCKET) up
    to LONG_PROMPT_STEP, then the smallest multiple of LONG_PROMPT_STEP (a 4,100-token prompt
    pads to 5,120, not 8,192; every width over 512 is a multiple of the attention query chunk)."""
    if length > LONG_PROMPT_STEP:
        return -(-length // LONG_PROMPT_STEP) * LONG_PROMPT_STEP
    return max(MIN_PROMPT_BUCKET, 1 << (max(length, 1) - 1).bit_length())


def encode_prompts(target: Target, prompts: Sequence[str | Sequence[int]]) -> list[list[int]]:
    """Token ids of each prompt; strings go through the chat template."""
    if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
        raise TypeError("prompts must be a list of strings or a list of token-id lists")
    if not prompts:
        raise ValueError("no prompts given")
    encoded = []
    for i, prompt in enumerate(prompts):
        if isinstance(prompt, str):
            if not prompt.strip():
                raise ValueError(f"prompt {i} is empty")
            if target.tokenizer is None:
                raise ValueError("this target has no tokenizer: pass token-id lists instead of strings")
            ids = chat_ids(target.tokenizer, prompt)
        else:
            ids = [int(t) for t in prompt]
            if not ids:
                raise ValueError(f"prompt {i} is empty")
        target.check_token_ids(np.asarray(ids))
        encoded.append(ids)
    return encoded


def chat_ids(tokenizer, text: str) -> list[int]:
    """The chat-templated token ids of one user turn, with the generation prompt."""
    messages = [{"role": "user", "content": text}]
    if tokenizer.chat_template:
        rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                                 enable_thinking=False)
        return list(tokenizer(rendered, add_special_tokens=False)["input_ids"])
    return list(tokenizer(text)["input_ids"])


class _Programs:
    """Compiled decode programs, keyed by (model structures, parameter shardings, shapes, statics)."""

    def __init__(self):
        self._cache = {}

    def get(self, key, fn, args, static_argnums, **static):
        """(compiled program, seconds spent compiling it now: 0 when cached)."""
        if key not in self._cache:
            start = time.perf_counter()
            jitted = jax.jit(fn, static_argnums=static_argnums, static_argnames=tuple(static))
            self._cache[key] = jitted.lower(*args, **static).compile()
            return self._cache[key], time.perf_counter() - start
        return self._cache[key], 0.0

    def clear(self):
        """Forgets every compiled program (and JAX's trace caches, so code changes apply)."""
        self._cache.clear()
        jax.clear_caches()


_PROGRAMS = _Programs()


def compiled_programs() -> list:
    """The decode programs ``generate`` has compiled so far (``jax.stages.Compiled``, in order)."""
    return list(_PROGRAMS._cache.values())


def clear_compiled_programs() -> None:
    """Forgets every compiled decode program (and JAX's trace caches, so code changes apply)."""
    _PROGRAMS.clear()


def _shardings(state) -> tuple:
    return tuple(leaf.sharding for leaf in jax.tree.leaves(state))


def _ratio(num, den):
    return float(num) / float(den) if den else None


COUNTERS = ("rounds", "tau_sum", "accepted", "proposed", "accepted_ge", "proposed_ge", "reached")


def stats_from_counters(counters: dict) -> dict:
    """Speculative statistics (DSPARK_SPEC.md section 7, Metrics) from summed counters.

    tau: mean over rounds of accepted + 1 (accepted only when an accepted EOS ends the round);
    proposal_len: drafts verified per round; verify_rate: accepted / (verified drafts + rounds);
    accept_rate_at_k[k-1]: rounds with more than k-1 accepted among rounds verifying more than
    k-1 (prefix survival at position k); conditional_acceptance[k-1]: accepted at k among rounds
    whose first k-1 were accepted and that verified position k (paper Fig. 2). ``counters``
    holds the raw sums, which add up over requests (:func:`sum_counters`).
    """
    c = counters
    return dict(
        rounds=c["rounds"],
        tau=_ratio(c["tau_sum"], c["rounds"]),
        accepted=c["accepted"],
        proposal_len=_ratio(c["proposed"], c["rounds"]),
        verify_rate=_ratio(c["accepted"], c["proposed"] + c["rounds"]),
        accept_rate_at_k=[_ratio(a, p) for a, p in zip(c["accepted_ge"], c["proposed_ge"])],
        conditional_acceptance=[_ratio(a, r) for a, r in zip(c["accepted_ge"], c["reached"])],
        counters=c,
    )


def sum_counters(counters: Sequence[dict]) -> dict:
    """Element-wise sum of ``stats["counters"]`` dicts (several requests or runs)."""
    if not counters:
        raise ValueError("no counters to sum")
    out = {}
    for name in COUNTERS:
        values = [c[name] for c in counters]
        out[name] = (np.sum(values, axis=0).tolist() if isinstance(values[0], list)
                     else int(sum(values)))
    return out


def speculative_stats(stats, row: int) -> dict:
    """Per-request statistics of a speculative run (:func:`stats_from_counters`); ``stats`` is a
    SpecStats of host (numpy) arrays."""
    counters = {name: getattr(stats, name)[row].tolist() for name in COUNTERS}
    return stats_from_counters(counters)


def generate(target: Target, prompts: Sequence[str | Sequence[int]], *, max_new_tokens: int,
             temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0, seed: int = 0,
             drafter=None, verify="full", verify_params: dict | None = None,
             buckets: Sequence[int] | None = None, record: bool = False) -> list[GenerationResult]:
    """Generates continuations for a batch of prompts.

    Args:
      target: from ``load_target``.
      prompts: strings (chat template applied) or lists of token ids.
      max_new_tokens: at most this many new tokens per prompt (EOS included).
      temperature: 0 is greedy; top_p / top_k: nucleus and top-k truncation (1.0 / 0 disable).
      seed: PRNG seed.
      drafter: a Drafter of ``target`` for speculative decoding (None: autoregressive). The
        output law is the target's (rejection sampling); greedy output equals greedy
        autoregressive output.
      verify: verification policy: "full", "fixed", "threshold", "prefix", "production" or a
        function (see ``dspark_jax.decoding.verification``).
      verify_params: its traced parameters, e.g. {"threshold": 0.5}, {"gamma": 2},
        {"sps": steps_per_second_by_batch_tokens}.
      buckets: token counts of the target's verify forward (default powers of two and P + 1).
      record: with a drafter, attach each request's per-round confidences and acceptance
        (``GenerationResult.trace``), the input of calibration and the confidence metrics.

    Returns:
      One GenerationResult per prompt, in order. ``stats`` holds new_tokens, prompt_tokens,
      steps (target forwards after prefill), compile_s (0 when the program was cached),
      wall_s (run time without compilation), tokens_per_s (all rows' new tokens / wall_s) and
      batch; with a drafter also the speculative statistics of :func:`speculative_stats`.
    """
    if max_new_tokens < 1:
        raise ValueError("max_new_tokens must be >= 1")
    if drafter is not None and drafter.target is not target:
        raise ValueError("the drafter was built for another target object")
    encoded = encode_prompts(target, prompts)
    batch = len(encoded)
    width = prompt_bucket(max(len(p) for p in encoded))
    tokens = np.full((batch, width), target.config.pad_token_id or 0, np.int32)
    for i, ids in enumerate(encoded):
        tokens[i, :len(ids)] = ids
    lens = jnp.asarray([len(p) for p in encoded], jnp.int32)
    params = autoregressive.SamplingParams.broadcast(batch, temperature, top_p, top_k)
    eos = jnp.asarray(target.eos_token_ids or (-1,), jnp.int32)
    inputs = (jnp.asarray(tokens), lens, jax.random.key(seed), params, eos)
    model_key = (target.graphdef, str(target.dtype), _shardings(target.state), batch, width,
                 eos.shape[0], max_new_tokens)
    if drafter is None:
        args = (target.graphdef, target.state) + inputs
        compiled, compile_s = _PROGRAMS.get(model_key, autoregressive.decode, args, (0,),
                                            max_new_tokens=max_new_tokens)
    else:
        proposals = drafter.num_proposals
        verify_buckets = verification.verify_buckets(proposals, buckets)
        policy_params = verification.default_params(verify, batch, proposals, verify_params,
                                                    drafter.confidence_temperatures)
        args = (target.graphdef, target.state, drafter.graphdef, drafter.state) + inputs + (
            policy_params,)
        key = model_key + (drafter.graphdef, str(drafter.dtype), _shardings(drafter.state),
                           verify_buckets, verify, policy_params["sps"].shape, record)
        compiled, compile_s = _PROGRAMS.get(key, speculative.decode, args, (0, 2),
                                            max_new_tokens=max_new_tokens, buckets=verify_buckets,
                                            policy=verify, record=record)
    dynamic = tuple(a for i, a in enumerate(args) if i not in ((0,) if drafter is None else (0, 2)))
    start = time.perf_counter()
    out = jax.block_until_ready(compiled(*dynamic))
    wall = time.perf_counter() - start
    out = jax.device_get(out)  # host arrays: rows are read one by one below
    out_tokens, counts = out.tokens, out.num_generated
    total = int(counts.sum())
    results = []
    for i in range(batch):
        ids = out_tokens[i, :counts[i]].tolist()
        text = target.tokenizer.decode(ids, skip_special_tokens=True) if target.tokenizer else ""
        stats = dict(new_tokens=len(ids), prompt_tokens=len(encoded[i]), steps=int(out.steps),
                     compile_s=compile_s, wall_s=wall, tokens_per_s=total / wall, batch=batch)
        trace = None
        if drafter is not None:
            stats.update(speculative_stats(out.stats, i))
            if record:
                trace = _row_trace(out.trace, i)
        results.append(GenerationResult(ids, text, stats, trace))
    return results


def _row_trace(trace: speculative.SpecTrace, row: int) -> dict:
    """One request's active rounds of a SpecTrace as numpy arrays."""
    active = np.asarray(trace.active[:, row])
    return dict(confidence_logits=np.asarray(trace.confidence_logits[:, row])[active],
                num_verified=np.asarray(trace.num_verified[:, row])[active],
                num_accepted=np.asarray(trace.num_accepted[:, row])[active])
