"""Query-chunked attention (long prefills) equals attention over all queries at once, and the
two-part attention over a KV cache equals attention over the concatenated keys."""

import jax
import jax.numpy as jnp
import numpy as np

import pytest

from dspark_jax.models.kv_cache import KVCache
from dspark_jax.models.layers import attend, attend_cached


def test_query_chunks_equal_one_pass():
    rng = np.random.default_rng(0)
    b, t, s, h, kv, d = 2, 32, 40, 6, 2, 8
    q = jnp.asarray(rng.normal(size=(b, t, h, d)), jnp.float32)
    k = jnp.asarray(rng.normal(size=(b, s, kv, d)), jnp.float32)
    v = jnp.asarray(rng.normal(size=(b, s, kv, d)), jnp.float32)
    mask = rng.random((b, t, s)) < 0.6
    mask[0, 3] = False  # a query that sees nothing gets zeros
    mask = jnp.asarray(mask)
    whole = jax.jit(lambda *a: attend(*a, query_chunk=t))(q, k, v, mask)
    chunked = jax.jit(lambda *a: attend(*a, query_chunk=8))(q, k, v, mask)
    np.testing.assert_allclose(np.asarray(chunked), np.asarray(whole), rtol=1e-6, atol=1e-6)
    assert np.all(np.asarray(whole)[0, 3] == 0)
    # The scores [b, kv, h / kv, queries, s]: 8 queries at a time in the chunked program.
    whole_hlo = jax.jit(lambda *a: attend(*a, query_chunk=t)).lower(q, k, v, mask).as_text()
    hlo = jax.jit(lambda *a: attend(*a, query_chunk=8)).lower(q, k, v, mask).as_text()
    assert "2x2x3x32x40xf32" in whole_hlo
    assert "2x2x3x8x40xf32" in hlo and "2x2x3x32x40xf32" not in hlo


@pytest.mark.parametrize("transposed_keys", [True, False])
@pytest.mark.parametrize("slots", [0, 11])
def test_cached_attention_equals_attention_over_the_concatenation(slots, transposed_keys):
    """New tokens over [cache; themselves] in the cache layout (keys [B, K, D, S], or
    [B, K, S, D] as on accelerators), no concat."""
    rng = np.random.default_rng(1)
    b, t, h, kv, d = 3, 4, 6, 2, 8
    q = jnp.asarray(rng.normal(size=(b, t, h, d)), jnp.float32)
    k_cache = jnp.asarray(rng.normal(size=(b, kv, d, slots)), jnp.float32)  # kv_cache.py layout
    layout_keys = k_cache if transposed_keys else k_cache.swapaxes(2, 3)
    v_cache = jnp.asarray(rng.normal(size=(b, kv, slots, d)), jnp.float32)
    k_new, v_new = (jnp.asarray(rng.normal(size=(b, t, kv, d)), jnp.float32) for _ in range(2))
    cache_visible = rng.random((b, t, slots)) < 0.5
    new_visible = np.tril(np.ones((t, t), bool)) & (rng.random((b, t, t)) < 0.8)
    new_visible[1, 2] = False
    cache_visible[1, 2] = False  # a query that sees nothing gets zeros
    got = jax.jit(lambda *a: attend_cached(*a, transposed_keys=transposed_keys))(
        q, layout_keys, v_cache, jnp.asarray(cache_visible), k_new, v_new, jnp.asarray(new_visible))
    keys = jnp.concatenate([k_cache.transpose(0, 3, 1, 2), k_new], axis=1)
    values = jnp.concatenate([v_cache.swapaxes(1, 2), v_new], axis=1)
    want = attend(q, keys, values, jnp.asarray(np.concatenate([cache_visible, new_visible], -1)))
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)
    assert np.all(np.asarray(got)[1, 2] == 0)


@pytest.mark.parametrize("transposed_keys", [True, False])
def test_cache_writes_land_in_the_head_major_layout(transposed_keys):
    """KVCache.write puts token t of row b at keys [.., b, :, :, position] (or,
    untransposed, [.., b, :, position, :]) and values [.., b, :, position, :]."""
    layers, b, slots, kv, d, t = 2, 3, 9, 2, 4, 2
    cache = KVCache.zeros(layers, b, slots, kv, d, jnp.float32, transposed_keys)
    key_shape = (layers, b, kv, d, slots) if transposed_keys else (layers, b, kv, slots, d)
    assert cache.k.shape == key_shape and cache.v.shape == (layers, b, kv, slots, d)
    assert cache.num_slots == slots
    new = jnp.arange(layers * b * t * kv * d, dtype=jnp.float32).reshape(layers, b, t, kv, d) + 1
    positions = jnp.asarray([[0, 1], [4, 5], [8, 9]])  # slot 9 is past the end: dropped
    written = cache.write(new, -new, positions)
    for row, slots_of_row in enumerate(np.asarray(positions)):
        for col, slot in enumerate(slots_of_row):
            if slot < slots:
                key = written.k[..., slot] if transposed_keys else written.k[:, :, :, slot]
                np.testing.assert_array_equal(key[:, row], new[:, row, col])
                np.testing.assert_array_equal(written.v[:, row, :, slot], -new[:, row, col])
    assert float(jnp.abs(written.k).sum()) == float(jnp.abs(new).sum() - jnp.abs(new[:, 2, 1]).sum())


@pytest.mark.parametrize("transposed_keys", [True, False])
@pytest.mark.parametrize("width", [3, 9, 11], ids=["short", "every slot", "past the end"])
def test_a_prefix_write_equals_writes_at_the_first_positions(transposed_keys, width):
    """KVCache.write_prefix (an admission's prompts) is KVCache.write at positions 0 .. W-1 of
    the rows given (rows beyond the cache and slots past its end dropped), over whatever the
    rows held before."""
    layers, slots, kv, d = 2, 9, 2, 4
    rng = np.random.default_rng(width)
    full = KVCache.zeros(layers, 4, slots, kv, d, jnp.float32, transposed_keys)
    cache = full.replace(k=jnp.asarray(rng.standard_normal(full.k.shape), jnp.float32),
                         v=jnp.asarray(rng.standard_normal(full.v.shape), jnp.float32))
    new = jnp.asarray(rng.standard_normal((layers, 3, width, kv, d)), jnp.float32)
    rows = jnp.asarray([2, 0, 7])  # row 7 is past the cache: dropped
    positions = jnp.broadcast_to(jnp.arange(width), (3, width))
    want = cache.write(new, -new, positions, rows)
    got = jax.jit(lambda c, k, v, r: c.write_prefix(k, v, r))(cache, new, -new, rows)
    np.testing.assert_array_equal(got.k, want.k)
    np.testing.assert_array_equal(got.v, want.v)
    np.testing.assert_array_equal(got.k[:, 1], cache.k[:, 1])  # a row not written is kept
