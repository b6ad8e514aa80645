"""Closed-loop load generation over the shared evaluation prompts.

``eval_prompts`` reads the first user turn of the shared eval sets (``{"turns": [...]}`` JSONL,
``prompts.load_benchmark``), applies the chat template and interleaves the sets
round-robin. ``closed_loop`` replays
prompts at a concurrency C: C users each send their next prompt as soon as their previous one
finished, until the prompts run out. It reports aggregate and per-user throughput, the mean
proposal length per request per step and tau.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Sequence

from dspark_jax.prompts import chat_ids, load_benchmark


def eval_prompts(tokenizer, datasets: Sequence[str], count: int, *, max_prompt_len: int,
                 data_dir: str | Path | None = None) -> list[list[int]]:
    """Chat-templated first turns, round-robin over ``datasets`` (benchmark names of
    ``prompts.BENCHMARKS``: the reference's cap and seeded shuffle apply).

    Prompts longer than ``max_prompt_len`` tokens are skipped.

    Raises:
      ValueError: no tokenizer, an unknown or missing set, or fewer than ``count`` usable prompts.
    """
    if tokenizer is None:
        raise ValueError("this target has no tokenizer: the eval prompts are text")
    turns = [load_benchmark(name, data_dir) for name in datasets]
    prompts = []
    for i in range(max(len(t) for t in turns)):
        for texts in turns:
            if i < len(texts) and len(prompts) < count:
                ids = chat_ids(tokenizer, texts[i])
                if len(ids) <= max_prompt_len:
                    prompts.append(ids)
    if len(prompts) < count:
        raise ValueError(f"only {len(prompts)} prompts of at most {max_prompt_len} tokens in "
                         f"{', '.join(datasets)}; asked for {count}")
    return prompts


@dataclasses.dataclass
class LoadResult:
    concurrency: int
    requests: int
    new_tokens: int
    wall_s: float
    steps: int
    tokens_per_s: float  # all users' new tokens / wall time
    tokens_per_s_per_user: float  # mean over requests of new tokens / (finish - submission)
    mean_proposal_len: float  # draft tokens verified per request per step
    tau: float  # emitted tokens per request per step (spec section 7)
    mean_verified_tokens: float  # forward tokens B per step
    bucket_counts: dict


def closed_loop(engine, prompts: Sequence[Sequence[int]], *, concurrency: int, max_new_tokens: int,
                temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0) -> LoadResult:
    """Replays ``prompts`` through ``engine`` with ``concurrency`` closed-loop users.

    The engine must be idle; its counters are reset. Compile first (``engine.compile``) so that
    no compilation is timed.
    """
    if concurrency < 1 or not prompts:
        raise ValueError("need concurrency >= 1 and at least one prompt")
    if engine.busy:
        raise RuntimeError("the engine is busy")
    engine.reset_stats()
    queue = list(prompts)[::-1]
    done = []

    def send():
        engine.submit(queue.pop(), max_new_tokens=max_new_tokens, temperature=temperature,
                      top_p=top_p, top_k=top_k)

    start = time.perf_counter()
    for _ in range(min(concurrency, len(queue))):
        send()
    while engine.busy:
        for request in engine.step():
            done.append(request)
            if queue:
                send()
    wall = time.perf_counter() - start
    new_tokens = sum(len(r.tokens) for r in done)
    rounds = sum(r.counters["rounds"] for r in done)
    per_user = [len(r.tokens) / (r.finished_at - r.submitted_at) for r in done]
    return LoadResult(
        concurrency=concurrency, requests=len(done), new_tokens=new_tokens, wall_s=wall,
        steps=engine.steps, tokens_per_s=new_tokens / wall,
        tokens_per_s_per_user=sum(per_user) / len(per_user),
        mean_proposal_len=(sum(r.counters["proposal_len_sum"] for r in done) / rounds
                           if rounds else 0.0),
        tau=sum(r.counters["tau_sum"] for r in done) / rounds if rounds else 0.0,
        mean_verified_tokens=engine.verified_tokens / engine.steps if engine.steps else 0.0,
        bucket_counts=dict(sorted(engine.bucket_counts.items())))
