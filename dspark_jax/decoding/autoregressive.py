"""Autoregressive decoding of a batch inside one jitted ``lax.while_loop``.

Prompts are right-padded to a bucket length; each row has its own prompt length, so each row
writes its next token at its own position (see kv_cache.py). The loop stops when every row has
emitted EOS or ``max_new_tokens`` tokens. Sampling parameters are traced arrays.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx, struct

from dspark_jax.decoding.sampling import sample
from dspark_jax.models.kv_cache import KVCache


@struct.dataclass
class SamplingParams:
    """Per-row sampling settings, each [B] (traced: changing them never recompiles)."""

    temperature: jax.Array
    top_p: jax.Array
    top_k: jax.Array

    @classmethod
    def broadcast(cls, batch: int, temperature=0.0, top_p=1.0, top_k=0) -> "SamplingParams":
        return cls(jnp.broadcast_to(jnp.asarray(temperature, jnp.float32), (batch,)),
                   jnp.broadcast_to(jnp.asarray(top_p, jnp.float32), (batch,)),
                   jnp.broadcast_to(jnp.asarray(top_k, jnp.int32), (batch,)))


class DecodeOutput(NamedTuple):
    tokens: jax.Array  # int32 [B, N]; entries past num_generated are padding
    num_generated: jax.Array  # int32 [B], EOS included
    steps: jax.Array  # int32 scalar: target forward passes after the prefill


def is_eos(tokens: jax.Array, eos_ids: jax.Array) -> jax.Array:
    """tokens int [...], eos_ids int [E] -> bool [...]."""
    return jnp.any(tokens[..., None] == eos_ids, axis=-1)


def decode(graphdef: nnx.GraphDef, state: nnx.State, prompts: jax.Array, prompt_lens: jax.Array,
           key: jax.Array, params: SamplingParams, eos_ids: jax.Array, *,
           max_new_tokens: int) -> DecodeOutput:
    """Greedy or sampled autoregressive decoding (jit with ``max_new_tokens`` static).

    Args:
      prompts: int32 [B, P] right-padded prompt tokens.
      prompt_lens: int32 [B] real prompt lengths (>= 1).
      key: PRNG key.
      params: per-row SamplingParams.
      eos_ids: int32 [E] tokens that end a row.
    """
    model = nnx.merge(graphdef, state)
    batch, prompt_width = prompts.shape
    cfg = model.cfg
    cache = KVCache.zeros(cfg.num_hidden_layers, batch, prompt_width + max_new_tokens,
                          cfg.num_key_value_heads, cfg.head_dim, model.dtype)
    rows = jnp.arange(batch)

    positions = jnp.broadcast_to(jnp.arange(prompt_width), prompts.shape)
    out = model(prompts, positions, cache=cache)
    last_hidden = out.hidden[rows, prompt_lens - 1]
    key, sub = jax.random.split(key)
    first, _ = sample(sub, model.logits(last_hidden), params.temperature, params.top_p, params.top_k)
    tokens = jnp.zeros((batch, max_new_tokens), jnp.int32).at[:, 0].set(first)
    done = is_eos(first, eos_ids) | (max_new_tokens <= 1)
    state0 = (jnp.int32(0), out.cache, tokens, jnp.ones((batch,), jnp.int32), done, key)

    def cond(carry):
        step, _, _, _, done, _ = carry
        return (step < max_new_tokens - 1) & ~jnp.all(done)

    def body(carry):
        step, cache, tokens, count, done, key = carry
        last = tokens[rows, count - 1]
        pos = (prompt_lens + count - 1)[:, None]
        out = model(last[:, None], pos, cache=cache)
        key, sub = jax.random.split(key)
        nxt, _ = sample(sub, model.logits(out.hidden[:, 0]), params.temperature, params.top_p,
                        params.top_k)
        write = ~done
        tokens = tokens.at[rows, jnp.minimum(count, max_new_tokens - 1)].set(
            jnp.where(write, nxt, tokens[rows, jnp.minimum(count, max_new_tokens - 1)]))
        count = count + write.astype(jnp.int32)
        done = done | (write & is_eos(nxt, eos_ids)) | (count >= max_new_tokens)
        return step + 1, out.cache, tokens, count, done, key

    steps, _, tokens, count, _, _ = jax.lax.while_loop(cond, body, state0)
    return DecodeOutput(tokens, count, steps)
