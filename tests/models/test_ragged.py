"""The flat (ragged) decoder forward equals the batched forward through a KV cache."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dspark_jax.models.kv_cache import KVCache
from dspark_jax.models.ragged import ragged_forward
from dspark_jax.target import init_target

QWEN3 = dict(architectures=["Qwen3ForCausalLM"], vocab_size=48, hidden_size=32, intermediate_size=64,
             num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=8)
# Sliding layers with a 4-token window: shorter than the rows' histories (5 and 9 tokens).
GEMMA3 = dict(QWEN3, architectures=["Gemma3ForCausalLM"], sliding_window=4,
              layer_types=["sliding_attention", "full_attention", "sliding_attention"])
# Gemma4: full layers of their own shape (head dim 16, one kv head, keys as values), so the
# layers run in three scans over two stacks and the cache holds two groups.
GEMMA4 = dict(GEMMA3, architectures=["Gemma4ForCausalLM"], global_head_dim=16,
              num_global_key_value_heads=1, attention_k_eq_v=True, hidden_size_per_layer_input=0,
              layer_types=["sliding_attention", "full_attention", "sliding_attention",
                           "full_attention"], num_hidden_layers=4)


@pytest.mark.parametrize("config", [QWEN3, GEMMA3, GEMMA4], ids=["qwen3", "gemma3", "gemma4"])
def test_ragged_forward_matches_batched_decoder(config):
    _ragged_against_batched(config)


def test_ragged_forward_over_an_accelerators_cache_layout():
    """Keys stored like values ([L, S, K, N, D], as off a CPU) and the Pallas decode kernel
    (interpret mode) on Gemma4's full layers, whose head dim (16) it tiles; its sliding layers
    take the einsum."""
    _ragged_against_batched(GEMMA4, transposed_keys=False, cache_attention="pallas")


def _ragged_against_batched(config, transposed_keys=True, cache_attention=None):
    target = init_target(config, seed=3)
    model = target.model
    rng = np.random.default_rng(0)
    slots, width, rows = 32, 4, 3
    starts = np.array([5, 0, 9])  # row 1 is empty: it gets no token
    counts = np.array([3, 0, 4])
    history = rng.integers(0, 48, (rows, slots))
    new = rng.integers(0, 48, (rows, width))
    cfg = model.config
    # Fill each row's history with a plain prefill; the batched reference then extends it.
    positions = jnp.broadcast_to(jnp.arange(slots), (rows, slots))
    cache, layout_cache = (model(jnp.asarray(history), positions,
                                 cache=KVCache.for_model(cfg, rows, slots, jnp.float32, keys)).cache
                           for keys in (True, transposed_keys))
    ref_pos = jnp.asarray(starts[:, None] + np.arange(width))
    ref = model(jnp.asarray(new), ref_pos, cache=cache, tap_layer_ids=(-1, 1), write_cache=False)

    flat_rows = np.concatenate([np.full(c, r) for r, c in enumerate(counts)] + [[rows, rows]])
    flat_cols = np.concatenate([np.arange(c) for c in counts] + [[0, 0]])
    tokens = new[np.minimum(flat_rows, rows - 1), flat_cols]
    flat_pos = starts[np.minimum(flat_rows, rows - 1)] + flat_cols
    forward = jax.jit(lambda *args: ragged_forward(model, *args, width=width, tap_layer_ids=(-1, 1),
                                                   cache_attention=cache_attention))
    out = forward(jnp.asarray(tokens), jnp.asarray(flat_pos), jnp.asarray(flat_rows),
                  jnp.asarray(flat_cols), jnp.asarray(starts), layout_cache)
    real = flat_rows < rows
    r, c = flat_rows[real], flat_cols[real]
    np.testing.assert_allclose(out.hidden[real], ref.hidden[r, c], atol=1e-5)
    np.testing.assert_allclose(out.taps[real], ref.taps[r, c], atol=1e-5)
    for got, want in zip(jax.tree.leaves(out.new_k), jax.tree.leaves(ref.new_kv[0]), strict=True):
        for row, count in enumerate(counts):
            np.testing.assert_allclose(got[:, row, :count], want[:, row, :count], atol=1e-5)
            assert not np.any(got[:, row, count:])
