"""Query-chunked attention (long prefills) equals attention over all queries at once."""

import jax
import jax.numpy as jnp
import numpy as np

from dspark_jax.models.layers import attend


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
