"""``dspark_jax.generate``: prompts in, tokens, text and statistics out.

An offline client of the engine (``engine/engine.py``), as vLLM's ``LLM.generate`` is of its
serving engine: the prompts are queued, ``max_batch`` of them decode together, and a finished
row's slot is refilled with the next prompt between rounds. Strings get the tokenizer's chat
template (``prompts.encode_prompts``); lists of ints are used as they are. Compiled programs are
shared by every call (``engine.compiled_programs``).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Sequence

from dspark_jax.engine import Engine
from dspark_jax.prompts import encode_prompts, prompt_bucket
from dspark_jax.target import Target

# Cache slots per row are rounded up to a multiple of this: calls whose prompt bucket and
# max_new_tokens differ a little run the same compiled programs.
CACHE_STEP = 32


@dataclasses.dataclass
class GenerationResult:
    token_ids: list[int]  # generated tokens, EOS included when one was emitted
    text: str  # decoded without special tokens
    stats: dict
    # With record=True: this request's rounds, {"confidence_logits": float32 [r, P],
    # "proposal_len": int32 [r], "num_accepted": int32 [r]} (numpy).
    trace: dict | None = None


def generate(target: Target, prompts: Sequence[str | Sequence[int]], *, max_new_tokens: int,
             temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0, seed: int = 0,
             drafter=None, verify="full", verify_params: dict | None = None,
             buckets: Sequence[int] | None = None, record: bool = False,
             max_batch: int | None = None, progress=None, on_finished=None,
             seeds: Sequence[int] | None = None, layer_weights: str | None = None,
             weight_dtype=None, draft_weight_dtype=None) -> list[GenerationResult]:
    """Generates continuations of prompts.

    Args:
      target: from ``load_target``.
      prompts: strings (chat template applied) or lists of token ids.
      max_new_tokens: at most this many new tokens per prompt (EOS included).
      temperature: 0 is greedy; top_p / top_k: nucleus and top-k truncation (1.0 / 0 disable).
      seed: PRNG seed (of the engine: each request draws from it and its place in
        ``prompts``).
      drafter: a Drafter of ``target`` for speculative decoding (None: autoregressive). The
        output law is the target's (rejection sampling); greedy output equals greedy
        autoregressive output.
      verify: verification policy: "full", "fixed", "threshold", "prefix", "production" or a
        function (see ``dspark_jax.scheduling.verification``).
      verify_params: its traced parameters, e.g. {"threshold": 0.5}, {"gamma": 2},
        {"sps": steps_per_second_by_batch_tokens}.
      buckets: flat token counts of the target's verify forward (default: powers of two up to
        rows x (P + 1), ``engine.token_buckets``).
      record: with a drafter, attach each request's per-round confidences and acceptance
        (``GenerationResult.trace``), the input of calibration and the confidence metrics.
      max_batch: rows decoded together (default: every prompt at once); further prompts join
        as rows finish (continuous batching).
      progress: called with the number of prompts that finished after each engine call.
      on_finished: called as ``on_finished(index, token_ids)`` for each prompt as it finishes
        (index: its place in ``prompts``), before the others are done: a long job writes its
        results as they come.
      seeds: one PRNG seed per prompt, each request's own stream (``Engine.submit``): its
        tokens then do not depend on the other prompts, ``max_batch`` or ``seed``.
      layer_weights: how the programs read the target's layer weights, "stacked" or
        "unstacked" (``Engine``; None: ``layer_weights.default_layout`` for the rows).
      weight_dtype: the target's weight matrices in this dtype, e.g. bfloat16 under a float32
        target (multiplied in bfloat16, accumulated in float32; ``Engine``); None: as loaded.
      draft_weight_dtype: the drafter's weight matrices in this dtype (``Engine``): a faster
        draft step where bfloat16 matmuls are fast, the same outputs (greedy: the same tokens);
        None: as loaded.

    Returns:
      One GenerationResult per prompt, in order. ``stats`` holds new_tokens, prompt_tokens,
      steps (target verify forwards of the whole run after the prefills), compile_s (0 when
      every program was cached), wall_s (run time without compilation), tokens_per_s (all new
      tokens / wall_s) and batch (the rows decoded together); with a drafter also the
      speculative statistics of ``engine.stats.stats_from_counters``.
    """
    if max_new_tokens < 1:
        raise ValueError("max_new_tokens must be >= 1")
    if max_batch is not None and max_batch < 1:
        raise ValueError("max_batch must be >= 1")
    if drafter is not None and drafter.target is not target:
        raise ValueError("the drafter was built for another target object")
    encoded = encode_prompts(target, prompts)
    if seeds is not None and len(seeds) != len(encoded):
        raise ValueError(f"{len(seeds)} seeds for {len(encoded)} prompts")
    rows = min(len(encoded), max_batch or len(encoded))
    proposals = 0 if drafter is None else drafter.num_proposals
    needed = prompt_bucket(max(len(p) for p in encoded)) + max_new_tokens + proposals + 1
    max_len = -(-needed // CACHE_STEP) * CACHE_STEP  # nearby max_new_tokens share programs
    engine = Engine(target, drafter, slots=rows, max_len=max_len, policy=verify,
                    policy_params=verify_params, buckets=buckets, seed=seed,
                    record_rounds=max_new_tokens if record and drafter is not None else 0,
                    layer_weights=layer_weights, weight_dtype=weight_dtype,
                    draft_weight_dtype=draft_weight_dtype)
    requests = [engine.submit(ids, max_new_tokens=max_new_tokens, temperature=temperature,
                              top_p=top_p, top_k=top_k, seed=None if seeds is None else seeds[i])
                for i, ids in enumerate(encoded)]
    index_of = {id(request): i for i, request in enumerate(requests)}

    def finished(done):
        if on_finished is not None:
            for request in done:
                on_finished(index_of[id(request)], list(request.tokens))
        if progress is not None:
            progress(len(done))

    start = time.perf_counter()
    engine.run(finished)
    wall = time.perf_counter() - start - engine.compile_s
    total = sum(len(r.tokens) for r in requests)
    results = []
    for ids, request in zip(encoded, requests):
        text = (target.tokenizer.decode(request.tokens, skip_special_tokens=True)
                if target.tokenizer else "")
        stats = dict(new_tokens=len(request.tokens), prompt_tokens=len(ids), steps=engine.steps,
                     compile_s=engine.compile_s, wall_s=wall, tokens_per_s=total / wall,
                     batch=rows)
        if drafter is not None:
            stats.update(request.stats)
        results.append(GenerationResult(request.tokens, text, stats, request.trace))
    return results
