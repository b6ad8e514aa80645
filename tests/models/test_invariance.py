"""On a CPU with the kernels (``cpu_matmul``, ``cpu_attention``): a token's logits in a verify
equal those of its decode step bit for bit, and a row's do not depend on the rows decoded beside
it, with float32 and with bfloat16 weight matrices, so greedy speculative decoding cannot part
from greedy autoregressive decoding, nor a prompt's output from the batch it is decoded in."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dspark_jax.models import cpu_attention, cpu_matmul
from dspark_jax.models.kv_cache import KVCache
from dspark_jax.models.ragged import ragged_forward
from dspark_jax.target import init_target

pytestmark = pytest.mark.skipif(not (cpu_matmul.available() and cpu_attention.available()),
                                reason="no CPU kernels here")

LLAMA = dict(architectures=["LlamaForCausalLM"], vocab_size=64, hidden_size=576,
             intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, max_position_embeddings=512)
PROMPT, NEW = 12, 6


@pytest.mark.parametrize("weight_dtype", [None, jnp.bfloat16], ids=["float32", "bfloat16"])
def test_verify_and_decode_steps_and_batches_give_a_token_the_same_bits(weight_dtype):
    target = init_target(LLAMA, seed=7)
    state = target.inference_state("unstacked", weight_dtype)
    rng = np.random.default_rng(0)
    prompts = rng.integers(4, 64, (3, PROMPT))
    new = rng.integers(4, 64, (3, NEW))

    @jax.jit
    def forward(cache, tokens, start):
        model = nnx.merge(target.graphdef, state)
        positions = start + jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
        out = model(tokens, positions, cache=cache)
        return model.logits(out.hidden), out.cache

    def prefilled(row):  # each prompt prefilled alone (a prefill's attention is XLA's)
        cache = KVCache.for_model(target.config, 1, 32, jnp.float32)
        return forward(cache, jnp.asarray(prompts[row:row + 1]), 0)[1]

    alone = [prefilled(row) for row in range(3)]
    together = jax.tree.map(lambda *rows: jnp.concatenate(rows, axis=1), *alone)
    verify, _ = forward(together, jnp.asarray(new), PROMPT)  # 3 rows x 6 tokens in one forward
    one, three = alone[0], together
    for t in range(NEW):  # one token per step: row 0 alone, and the 3 rows together
        step, one = forward(one, jnp.asarray(new[:1, t:t + 1]), PROMPT + t)
        np.testing.assert_array_equal(step[0, 0], verify[0, t])
        steps, three = forward(three, jnp.asarray(new[:, t:t + 1]), PROMPT + t)
        np.testing.assert_array_equal(steps[:, 0], verify[:, t])


@pytest.mark.parametrize("weight_dtype", [None, jnp.bfloat16], ids=["float32", "bfloat16"])
def test_a_verify_scattered_into_the_grid_equals_the_grid(weight_dtype):
    """The engine's verify runs its top bucket as the whole [S, Q] grid and smaller buckets as
    flat tokens scattered into it (``ragged_forward(dense=)``): the same tokens get the same
    bits both ways (the rotary embedding's sum was contracted differently by XLA:CPU)."""
    target = init_target(LLAMA, seed=7)
    state = target.inference_state("unstacked", weight_dtype)
    rng = np.random.default_rng(1)
    prompt = jnp.asarray(rng.integers(4, 64, (1, PROMPT)))
    tokens = jnp.asarray(rng.integers(4, 64, (8,)))
    start = jnp.asarray([PROMPT], jnp.int32)

    @jax.jit
    def prefill(cache):
        model = nnx.merge(target.graphdef, state)
        return model(prompt, jnp.arange(PROMPT)[None], cache=cache).cache

    cache = prefill(KVCache.for_model(target.config, 1, 32, jnp.float32))

    @functools.partial(jax.jit, static_argnums=(1, 2))
    def verify(cache, size, dense):
        model = nnx.merge(target.graphdef, state)
        cols = jnp.arange(size, dtype=jnp.int32)
        out = ragged_forward(model, tokens[:size], PROMPT + cols, jnp.zeros_like(cols), cols,
                             start, cache, width=8, dense=dense)
        return model.logits(out.hidden)

    grid = np.asarray(verify(cache, 8, True))
    for size in (1, 2, 4, 8):
        np.testing.assert_array_equal(np.asarray(verify(cache, size, False)), grid[:size])
