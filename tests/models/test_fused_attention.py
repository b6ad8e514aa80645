"""The fused attention paths of the packed target forward equal the einsum reference: the
kernels alone and the whole decoder, with segments, padding, GQA and sliding windows.

``xla`` is jax.nn.dot_product_attention's portable implementation (the arguments the cuDNN
route passes, checked on a CPU); ``splash`` runs splash attention's Pallas kernel in interpret
mode, as a TPU would run it compiled."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dspark_jax.models import fused_attention
from dspark_jax.target import init_target

FUSED = ("xla", "splash")


def _segments(rng, b, t):
    """Segment ids of packed rows: several segments and trailing padding (0)."""
    ids = np.zeros((b, t), np.int32)
    for row in range(b):
        cuts = np.sort(rng.choice(np.arange(1, t - 8), 3, replace=False))
        for seg, (lo, hi) in enumerate(zip([0, *cuts], [*cuts, t - 8 * row]), start=1):
            ids[row, lo:hi] = seg
    return jnp.asarray(ids)


@pytest.mark.parametrize("implementation", FUSED)
@pytest.mark.parametrize("window", [None, 9])
def test_kernels_equal_the_einsum_reference(implementation, window):
    rng = np.random.default_rng(0)
    b, t, h, kv, d = 2, 256, 6, 2, 32
    q, k, v = (jnp.asarray(rng.normal(size=(b, t, n, d)), jnp.float32) for n in (h, kv, kv))
    segments = _segments(rng, b, t)
    ref = fused_attention.attend_segments(q, k, v, segments, scale=0.2, window=window,
                                          implementation="einsum")
    out = jax.jit(lambda *a: fused_attention.attend_segments(
        *a, scale=0.2, window=window, implementation=implementation))(q, k, v, segments)
    real = np.asarray(segments) != 0
    assert np.abs(np.asarray(ref)[real]).max() > 0.1
    np.testing.assert_allclose(np.asarray(out)[real], np.asarray(ref)[real], atol=2e-5)


GEMMA4 = dict(architectures=["Gemma4ForCausalLM"], vocab_size=64, hidden_size=32,
              intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, head_dim=8, global_head_dim=16, num_global_key_value_heads=1,
              attention_k_eq_v=True, hidden_size_per_layer_input=0, sliding_window=5,
              layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"])
GEMMA3 = dict(GEMMA4, architectures=["Gemma3ForCausalLM"])
QWEN3 = dict(GEMMA4, architectures=["Qwen3ForCausalLM"], layer_types=None, sliding_window=None)


@pytest.mark.parametrize("implementation", FUSED)
@pytest.mark.parametrize("config", [QWEN3, GEMMA3, GEMMA4], ids=["qwen3", "gemma3", "gemma4"])
def test_the_packed_target_forward_equals_the_masked_one(config, implementation):
    """Gemma3 mixes its layer types in one stack: the fused forward runs them in scans of one
    type each, so that a sliding layer's window is static."""
    target = init_target({k: v for k, v in config.items() if v is not None}, seed=1)
    model = target.model
    rng = np.random.default_rng(2)
    b, t = 2, 128
    segments = _segments(rng, b, t)
    tokens = jnp.asarray(rng.integers(0, 64, (b, t)))
    starts = np.asarray(jax.vmap(lambda s: jnp.searchsorted(s, s, side="left"))(segments))
    positions = jnp.asarray(np.arange(t)[None] - starts)  # restart at every segment
    taps = (-1, 1, 3)
    ref = model(tokens, positions, mask=fused_attention.segment_mask(segments), tap_layer_ids=taps)
    out = jax.jit(lambda m_tokens, m_pos, m_seg: model(
        m_tokens, m_pos, segment_ids=m_seg, attention=implementation, tap_layer_ids=taps))(
        tokens, positions, segments)
    real = np.asarray(segments) != 0
    np.testing.assert_allclose(np.asarray(out.hidden)[real], np.asarray(ref.hidden)[real], atol=1e-4)
    np.testing.assert_allclose(np.asarray(out.taps)[real], np.asarray(ref.taps)[real], atol=1e-4)


def test_bad_uses_are_named():
    x = jnp.zeros((1, 100, 2, 8))
    segments = jnp.ones((1, 100), jnp.int32)
    with pytest.raises(ValueError, match="multiple of 128, got 100"):
        fused_attention.attend_segments(x, x, x, segments, implementation="splash")
    with pytest.raises(ValueError, match="unknown attention implementation 'flash'"):
        fused_attention.attend_segments(x, x, x, segments, implementation="flash")
    model = init_target({k: v for k, v in QWEN3.items() if v is not None}, seed=1).model
    tokens = jnp.zeros((1, 4), jnp.int32)
    with pytest.raises(ValueError, match="segment_ids replace the mask"):
        model(tokens, tokens, segment_ids=tokens, mask=jnp.ones((1, 4, 4), bool))


@pytest.mark.parametrize("implementation", FUSED)
def test_the_engine_prefill_equals_the_einsum_one(implementation):
    """The engine's ragged prefill (a cache of no slots): rows of different lengths in a grid
    of 128 columns, over Gemma4's interleaved stacks and sliding windows."""
    from dspark_jax.models.kv_cache import KVCache
    from dspark_jax.models.ragged import ragged_forward

    target = init_target(GEMMA4, seed=3)
    model = target.model
    rng = np.random.default_rng(4)
    lengths, width = np.array([100, 37, 128]), 128
    rows = np.concatenate([np.full(n, r) for r, n in enumerate(lengths)] + [[3, 3]])
    cols = np.concatenate([np.arange(n) for n in lengths] + [[0, 0]])
    tokens = jnp.asarray(rng.integers(0, 64, rows.shape))
    cache = KVCache.for_model(model.config, len(lengths), 0, jnp.float32)

    def prefill(impl):
        return jax.jit(lambda *a: ragged_forward(model, *a, width=width, tap_layer_ids=(1, 2),
                                                 attention=impl))(
            tokens, jnp.asarray(cols), jnp.asarray(rows), jnp.asarray(cols),
            jnp.zeros(len(lengths), jnp.int32), cache)

    ref, out = prefill("einsum"), prefill(implementation)
    real = rows < len(lengths)
    np.testing.assert_allclose(np.asarray(out.hidden)[real], np.asarray(ref.hidden)[real], atol=1e-4)
    np.testing.assert_allclose(np.asarray(out.taps)[real], np.asarray(ref.taps)[real], atol=1e-4)
    for got, want in zip(jax.tree.leaves(out.new_k), jax.tree.leaves(ref.new_k), strict=True):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-4)
