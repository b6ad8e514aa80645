"""``training.cpu_vocab_loss``: the kernel's loss terms and gradient equal the jnp definition
to float32 rounding, for every vocabulary width and for slots where nothing or everything
differs, and the kernel is in the train step's program where it applies."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dspark_jax.training import cpu_vocab_loss

pytestmark = pytest.mark.skipif(not cpu_vocab_loss.available(), reason="no loss kernel here")


def _slots(n, v, seed, scale=3.0):
    rng = np.random.default_rng(seed)
    z = (scale * rng.standard_normal((n, v))).astype(np.float32)
    t = (z + rng.standard_normal((n, v)) * rng.uniform(0, 2, (n, 1))).astype(np.float32)
    labels = rng.integers(0, v, n).astype(np.int32)
    c_ce, c_l1 = (rng.uniform(0, 1, n).astype(np.float32) for _ in range(2))
    return z, t, labels, c_ce, c_l1


# (slots, vocabulary): less than a vector, a vector and a tail, SmolLM2's 49,152
@pytest.mark.parametrize("n,v", [(3, 7), (5, 37), (4, 49152)])
def test_the_kernel_equals_the_definition(n, v):
    args = _slots(n, v, seed=v)
    args[2][0], args[2][-1] = 0, v - 1  # labels at both ends of the row
    got = jax.jit(cpu_vocab_loss.slot_terms_and_gradient)(*args)
    want = jax.jit(cpu_vocab_loss.reference)(*args)
    for name, a, b in zip(("g", "ce", "l1"), got, want):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-5, atol=1e-7, err_msg=name)


def test_equal_and_far_apart_distributions():
    """Slot 0: the target's logits are the draft's (L1 = 0 and no sign: the gradient is CE's
    alone, where the definition's softmaxes differ in the last bits and take a sign at random);
    slot 1: logits of +-80 (the exps' range); slot 2: a zero weight gives a zero gradient."""
    z, t, labels, c_ce, c_l1 = _slots(3, 300, seed=1)
    t[0] = z[0]
    z[1] = np.where(np.arange(300) % 2, 80.0, -80.0)
    c_ce[2] = c_l1[2] = 0.0
    kernel = jax.jit(cpu_vocab_loss.slot_terms_and_gradient)
    g, ce, l1 = map(np.asarray, kernel(z, t, labels, c_ce, c_l1))
    wg, wce, wl1 = map(np.asarray, jax.jit(cpu_vocab_loss.reference)(z, t, labels, c_ce, c_l1))
    assert l1[0] == 0.0
    p = np.exp(z[0] - z[0].max()) / np.exp(z[0] - z[0].max()).sum()
    np.testing.assert_allclose(g[0], c_ce[0] * (p - np.eye(300)[labels[0]]), rtol=2e-5, atol=1e-8)
    np.testing.assert_allclose(g[1:], wg[1:], rtol=2e-5, atol=1e-7)
    np.testing.assert_allclose(ce, wce, rtol=2e-5)
    np.testing.assert_allclose(l1, wl1, rtol=2e-5, atol=1e-6)
    assert not g[2].any()


def test_the_kernel_is_chosen_only_where_it_applies():
    z, t, labels, c_ce, c_l1 = _slots(2, 40, seed=2)

    def hlo(*args):
        return jax.jit(cpu_vocab_loss.slot_terms_and_gradient).lower(*args).as_text()

    assert cpu_vocab_loss.TARGET in hlo(z, t, labels, c_ce, c_l1)
    assert cpu_vocab_loss.TARGET not in hlo(z.astype(jnp.bfloat16), t, labels, c_ce, c_l1)
    with pytest.raises(jax.errors.JaxRuntimeError, match="vocab_loss: z and t"):
        cpu_vocab_loss._kernel(z, t, labels[:1], c_ce, c_l1)[0].block_until_ready()
