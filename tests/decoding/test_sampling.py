"""The two-level inverse-CDF draw: its law computed over grids of uniforms, and its edge cases."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dspark_jax.decoding import sampling
from dspark_jax.decoding.sampling import inverse_cdf, sample_from_probs

BLOCK = 16
GRID = 4096  # uniforms at the midpoints of GRID equal cells


def _rows():
    """Rows over a vocabulary that is not a multiple of BLOCK, with zero tokens, a zero block,
    mass only in the last (padded-block) token, and a point mass."""
    rng = np.random.default_rng(0)
    vocab = 5 * BLOCK + 7
    p = rng.exponential(size=(4, vocab)) * (rng.random((4, vocab)) < 0.6)
    p[0, BLOCK:2 * BLOCK] = 0.0  # an empty block
    p[1] = 0.0
    p[1, [3, vocab - 1]] = [0.25, 0.75]  # mass in the last token of the padded block
    p[2] = 0.0
    p[2, 40] = 1.0
    p[3, :BLOCK] = 1e-6  # a block of tiny mass next to large ones
    return (p / p.sum(-1, keepdims=True)).astype(np.float32)


def _grid():
    return (np.arange(GRID, dtype=np.float32) + 0.5) / GRID


def test_block_and_token_laws_computed_over_uniform_grids():
    """P(token) = P(block) * P(token | block): each factor is the measure of the uniforms that
    select it, counted on a grid of GRID cells (exact to 1 / GRID per boundary)."""
    p = _rows()
    rows, vocab = p.shape
    u = _grid()
    pick = jax.jit(lambda probs, ub, ut: inverse_cdf(probs, ub, ut, block=BLOCK))
    num_blocks = -(-vocab // BLOCK)
    padded = np.pad(p, [(0, 0), (0, num_blocks * BLOCK - vocab)]).reshape(rows, num_blocks, BLOCK)
    block_mass = padded.sum(-1)
    for r in range(rows):
        row = jnp.asarray(np.broadcast_to(p[r], (GRID, vocab)))
        tokens = np.asarray(pick(row, jnp.asarray(u), jnp.full((GRID,), 0.5)))
        assert np.all(p[r, tokens] > 0)
        block_law = np.bincount(tokens // BLOCK, minlength=num_blocks) / GRID
        np.testing.assert_allclose(block_law, block_mass[r], atol=2.0 / GRID)
        for b in np.flatnonzero(block_mass[r] > 0):
            # the midpoint of block b's interval of u_block, then the u_token grid
            start = block_mass[r, :b].sum()
            mid = np.full((GRID,), start + block_mass[r, b] / 2, np.float32)
            tokens = np.asarray(pick(row, jnp.asarray(mid), jnp.asarray(u)))
            assert np.all(tokens // BLOCK == b) and np.all(p[r, tokens] > 0)
            law = np.bincount(tokens - b * BLOCK, minlength=BLOCK) / GRID
            np.testing.assert_allclose(law, padded[r, b] / block_mass[r, b], atol=2.0 / GRID)


@pytest.mark.parametrize("u", [0.0, 1.0 - 2.0 ** -24])
def test_extreme_uniforms_never_pick_zero_mass(u):
    p = _rows()
    full = jnp.full((p.shape[0],), u, jnp.float32)
    tokens = np.asarray(inverse_cdf(jnp.asarray(p), full, full, block=BLOCK))
    assert np.all(p[np.arange(p.shape[0]), tokens] > 0), tokens
    assert tokens[2] == 40
    assert tokens[1] == (3 if u == 0.0 else p.shape[1] - 1)


def test_sample_from_probs_draws_the_row_law():
    p = _rows()[:2]
    n = 40000
    keys = jax.random.split(jax.random.key(11), n)
    tokens = np.asarray(jax.jit(jax.vmap(lambda k: sample_from_probs(k, jnp.asarray(p))))(keys))
    for r in range(2):
        counts = np.bincount(tokens[:, r], minlength=p.shape[1])
        assert np.all(counts[p[r] == 0] == 0)
        support = p[r] > 0
        expected = n * p[r, support]
        stat = float(((counts[support] - expected) ** 2 / expected).sum())
        df = int(support.sum()) - 1
        assert stat < df + 5 * np.sqrt(2 * df), (stat, df)  # far inside the chi-square tail


def test_a_key_per_row_draws_each_row_from_its_own_key():
    """With a key array [b], row i's draws equal those of key i alone, whatever the batch."""
    keys = jax.random.split(jax.random.key(5), 3)
    batch = sampling.uniform(keys, (3, 4))
    for i in range(3):
        np.testing.assert_array_equal(batch[i], sampling.uniform(keys[i:i + 1], (1, 4))[0])
    np.testing.assert_array_equal(sampling.uniform(keys[1], (4,)),
                                  jax.random.uniform(keys[1], (4,)))
    probs = jax.nn.softmax(jax.random.normal(jax.random.key(6), (3, 50)), axis=-1)
    drawn = sampling.sample_from_probs(keys, probs)
    for i in range(3):
        assert drawn[i] == sampling.sample_from_probs(keys[i:i + 1], probs[i:i + 1])[0]
    first, second = sampling.split_key(keys)
    assert first.shape == second.shape == (3,)
    np.testing.assert_array_equal(jax.random.key_data(sampling.fold_key(keys, 2)[1]),
                                  jax.random.key_data(jax.random.fold_in(keys[1], 2)))
