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

from dspark_jax.decoding import autoregressive
from dspark_jax.target import Target

MIN_PROMPT_BUCKET = 16


@dataclasses.dataclass
class GenerationResult:
    token_ids: list[int]  # generated tokens, EOS included when one was emitted
    text: str  # decoded without special tokens
    stats: dict


def prompt_bucket(length: int) -> int:
    """Smallest power of two >= length (and >= MIN_PROMPT_BUCKET)."""
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
    """Compiled decode programs, keyed by (model structure, parameter shardings, shapes, statics)."""

    def __init__(self):
        self._cache = {}

    def get(self, key, fn, *args, **static):
        if key not in self._cache:
            start = time.perf_counter()
            jitted = jax.jit(fn, static_argnums=(0,), static_argnames=tuple(static))
            compiled = jitted.lower(*args, **static).compile()
            self._cache[key] = (compiled, time.perf_counter() - start)
            return compiled, self._cache[key][1]
        return self._cache[key][0], 0.0


_PROGRAMS = _Programs()


def generate(target: Target, prompts: Sequence[str | Sequence[int]], *, max_new_tokens: int,
             temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0, seed: int = 0,
             drafter=None) -> list[GenerationResult]:
    """Generates continuations for a batch of prompts.

    Args:
      target: from ``load_target``.
      prompts: strings (chat template applied) or lists of token ids.
      max_new_tokens: at most this many new tokens per prompt (EOS included).
      temperature: 0 is greedy; top_p / top_k: nucleus and top-k truncation (1.0 / 0 disable).
      seed: PRNG seed.
      drafter: a DSpark drafter for speculative decoding (None: autoregressive).

    Returns:
      One GenerationResult per prompt, in order. ``stats`` holds new_tokens, steps (target
      forwards after prefill), compile_s (0 when the program was cached), wall_s (run time
      without compilation) and tokens_per_s (all rows' new tokens / wall_s).
    """
    if drafter is not None:
        raise NotImplementedError("speculative decoding (drafter=...) is not available yet")
    if max_new_tokens < 1:
        raise ValueError("max_new_tokens must be >= 1")
    encoded = encode_prompts(target, prompts)
    batch = len(encoded)
    width = prompt_bucket(max(len(p) for p in encoded))
    tokens = np.full((batch, width), target.config.pad_token_id or 0, np.int32)
    for i, ids in enumerate(encoded):
        tokens[i, :len(ids)] = ids
    lens = jnp.asarray([len(p) for p in encoded], jnp.int32)
    params = autoregressive.SamplingParams.broadcast(batch, temperature, top_p, top_k)
    eos = jnp.asarray(target.eos_token_ids or (-1,), jnp.int32)
    args = (target.graphdef, target.state, jnp.asarray(tokens), lens, jax.random.key(seed), params, eos)
    shardings = tuple(leaf.sharding for leaf in jax.tree.leaves(target.state))
    program_key = (target.graphdef, str(target.dtype), shardings, batch, width, eos.shape[0],
                   max_new_tokens)
    compiled, compile_s = _PROGRAMS.get(program_key, autoregressive.decode, *args,
                                        max_new_tokens=max_new_tokens)
    start = time.perf_counter()
    out = jax.block_until_ready(compiled(*args[1:]))
    wall = time.perf_counter() - start
    out_tokens, counts = np.asarray(out.tokens), np.asarray(out.num_generated)
    total = int(counts.sum())
    results = []
    for i in range(batch):
        ids = out_tokens[i, :counts[i]].tolist()
        text = target.tokenizer.decode(ids, skip_special_tokens=True) if target.tokenizer else ""
        stats = dict(new_tokens=len(ids), prompt_tokens=len(encoded[i]), steps=int(out.steps),
                     compile_s=compile_s, wall_s=wall, tokens_per_s=total / wall, batch=batch)
        results.append(GenerationResult(ids, text, stats))
    return results
