"""``models.cpu_matmul``: the few-row float32 product on x86 CPUs computes x @ w to float32
rounding, gives each row the same bits whatever the other rows, stays out of programs it does
not apply to, and differentiates."""

import functools
import math
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dspark_jax.models import cpu_kernels, cpu_matmul

pytestmark = pytest.mark.skipif(not cpu_matmul.available(), reason="no cpu_matmul kernel here")

# (leading dims of x, K, N): register tiles of 8 rows / 48 columns or fewer rows / 64 columns
# (4 for the transposed form)
# with remainders, K and N off the 16-float vectors, one contraction element, a SmolLM2 matrix.
SHAPES = [((1,), 576, 1536), ((8,), 576, 1536), ((16,), 33, 200), ((2, 3), 100, 37),
          ((7,), 1, 5), ((5,), 17, 3), ((3, 1), 1536, 576)]


def _operands(lead, k, n, transpose_w, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(lead + (k,)).astype(np.float32)
    w = rng.standard_normal((n, k) if transpose_w else (k, n)).astype(np.float32)
    return x, w


@pytest.mark.parametrize("transpose_w", [False, True], ids=["w[K,N]", "w[N,K]"])
@pytest.mark.parametrize("lead,k,n", SHAPES)
def test_the_product_is_x_times_w_and_each_rows_bits_do_not_depend_on_the_others(
        lead, k, n, transpose_w):
    x, w = _operands(lead, k, n, transpose_w)
    product = jax.jit(lambda x, w: cpu_matmul.matmul(x, w, transpose_w))
    y = np.asarray(product(x, w))
    want = x.astype(np.float64) @ (w.T if transpose_w else w).astype(np.float64)
    assert y.shape == lead + (n,) and y.dtype == np.float32
    # float32 rounding of a k-term sum of products of unit normals
    np.testing.assert_allclose(y, want, rtol=0, atol=4e-6 * np.sqrt(k) * 8)
    rows = x.reshape(-1, k)
    alone = np.concatenate([np.asarray(product(rows[i:i + 1], w)) for i in range(len(rows))])
    np.testing.assert_array_equal(alone, y.reshape(-1, n))


def _custom_calls(f, *args, **lower) -> int:
    text = jax.jit(f).trace(*args).lower(**lower).as_text()
    return sum(text.count(f"@{t}(") for t in cpu_matmul.TARGETS.values())  # the float32 ones


def test_the_kernel_runs_only_where_it_applies():
    w = jnp.ones((64, 32), jnp.float32)
    f = cpu_matmul.matmul
    assert _custom_calls(f, jnp.ones((cpu_matmul.MAX_ROWS, 64)), w) == 1
    assert _custom_calls(f, jnp.ones((cpu_matmul.MAX_ROWS + 1, 64)), w) == 0  # XLA's dot
    assert _custom_calls(f, jnp.ones((2, 64), jnp.bfloat16), w.astype(jnp.bfloat16)) == 0
    # Lowered for another platform, the program multiplies with XLA's dot.
    assert _custom_calls(f, jnp.ones((2, 64)), w, lowering_platforms=("cuda",)) == 0
    assert not cpu_matmul.applies(jnp.ones((2, 64)), w, preferred_element_type=jnp.bfloat16)


def test_it_differentiates_and_batches_as_the_einsum_does():
    x, w = _operands((3,), 20, 24, True, seed=1)

    def loss(product, x, w):
        return jnp.sum(jnp.sin(product(x, w)))

    kernel = jax.grad(lambda x, w: loss(lambda a, b: cpu_matmul.matmul(a, b, True), x, w), (0, 1))
    einsum = jax.grad(lambda x, w: loss(lambda a, b: jnp.einsum("mk,nk->mn", a, b), x, w), (0, 1))
    for a, b in zip(kernel(x, w), einsum(x, w)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
    batched = jax.jit(jax.vmap(lambda x: cpu_matmul.matmul(x, w, True)))(x[:, None])
    np.testing.assert_allclose(batched[:, 0], x @ w.T, rtol=1e-5, atol=1e-5)


def test_it_can_be_turned_off_and_a_missing_compiler_is_named(tmp_path, monkeypatch):
    env = dict(os.environ, DSPARK_JAX_CPU_MATMUL="0")
    off = subprocess.run([sys.executable, "-c", "from dspark_jax.models import cpu_matmul; "
                          "print(cpu_matmul.available())"], env=env, capture_output=True,
                         text=True, check=True)
    assert off.stdout.strip() == "False"
    monkeypatch.setenv("DSPARK_JAX_CACHE", str(tmp_path))
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    with pytest.raises(RuntimeError, match="cannot run the C\\+\\+ compiler .*no-such-compiler"):
        cpu_kernels.build(cpu_matmul.SOURCE)
    assert not list(tmp_path.rglob("*.so*"))  # nothing partial left behind


def test_row_sums_do_not_depend_on_the_other_rows():
    x = jnp.asarray(np.random.default_rng(4).standard_normal((40, 576)).astype(np.float32))
    sums = jax.jit(cpu_matmul.row_sum)
    got = np.asarray(sums(x))
    np.testing.assert_allclose(got, np.asarray(x, np.float64).sum(-1), rtol=0, atol=1e-4)
    for rows in (1, 3, 8):
        np.testing.assert_array_equal(np.asarray(sums(x[:rows])), got[:rows])
    grad = jax.grad(lambda x: jnp.sum(jnp.sin(cpu_matmul.row_sum(x))))(x[:2])
    np.testing.assert_allclose(grad, jnp.cos(x[:2].sum(-1))[:, None] * jnp.ones_like(x[:2]),
                               rtol=1e-5, atol=1e-5)
    assert sums(x.astype(jnp.bfloat16)).dtype == jnp.bfloat16  # another dtype: jnp.sum


# (leading dims, K): a row per lane with masked tails, several work items of 256 rows, the
# rotary's pairs, single elements, a norm's rows
@pytest.mark.parametrize("lead,k", [((1,), 576), ((17,), 5), ((3, 200), 33), ((2, 300, 3), 2),
                                    ((40,), 1), ((16,), 576)])
def test_a_row_sum_adds_the_row_in_order_as_the_product_by_ones_does(lead, k):
    x = np.random.default_rng(k).standard_normal(lead + (k,)).astype(np.float32) * 1e3
    x[..., ::7] *= 1e-6  # magnitudes far apart, so that another order would round otherwise
    got = np.asarray(jax.jit(cpu_matmul.row_sum)(x))
    want = np.add.accumulate(x, axis=-1, dtype=np.float32)[..., -1]  # in order, in float32
    np.testing.assert_array_equal(got, want)
    by_ones = jax.jit(lambda x: cpu_matmul.matmul(x, jnp.ones((k, 1), jnp.float32))[..., 0])
    if math.prod(lead) <= cpu_matmul.MAX_ROWS:
        np.testing.assert_array_equal(got, np.asarray(by_ones(x)))
    signed = np.asarray(jax.jit(cpu_matmul.row_sum)(np.full((3, 2), -0.0, np.float32)))
    assert not np.signbit(signed).any()  # from +0, as the fused multiply-add chain starts


@pytest.fixture(params=[cpu_matmul.AMX, cpu_matmul.AVX512_BF16], ids=["amx", "avx512_bf16"])
def bf16_kernel(request, monkeypatch):
    """Each bfloat16 kernel this host supports, made the one :func:`cpu_matmul.matmul` runs."""
    kernel = request.param
    if not cpu_matmul.supported(kernel):
        pytest.skip(f"{kernel.source} does not run here")
    monkeypatch.setattr(cpu_matmul, "bfloat16_kernel", lambda: kernel)
    return kernel


# (leading dims of x, K, N): streamed rows (1, 3, 8, 16), batches of 17 to 64 rows (one or
# two row groups per 32 rows of w[K, N]; two to four row groups of w[N, K]'s result tiles),
# a last strip of 16 columns, a single tile step (K = 32), SmolLM2 matrices; AVX-512 BF16's
# register tiles of up to 8 rows x 64 columns with remainders.
BF16_SHAPES = [((1,), 576, 1536), ((8,), 1536, 576), ((16,), 64, 48), ((17,), 64, 48),
               ((2, 16), 96, 80), ((3,), 32, 16), ((40,), 64, 112), ((2, 25), 64, 32),
               ((5,), 64, 208), ((cpu_matmul.BF16_MAX_ROWS,), 96, 48)]


@pytest.mark.parametrize("transpose_w", [False, True], ids=["w[K,N]", "w[N,K]"])
@pytest.mark.parametrize("lead,k,n", BF16_SHAPES)
def test_the_bfloat16_product_of_bfloat16_rows_and_each_rows_bits_do_not_depend_on_the_others(
        bf16_kernel, lead, k, n, transpose_w):
    x, w = (jnp.asarray(a, jnp.bfloat16) for a in _operands(lead, k, n, transpose_w))
    assert cpu_matmul.applies(x, w, jnp.float32, transpose_w)
    product = jax.jit(lambda x, w: cpu_matmul.matmul(x, w, transpose_w))
    assert f"@{bf16_kernel.targets[transpose_w]}(" in product.lower(x, w).as_text()
    y = np.asarray(product(x, w))
    xf, wf = np.asarray(x, np.float64), np.asarray(w, np.float64)
    want = xf @ (wf.T if transpose_w else wf)  # the bfloat16 values' products are exact
    assert y.shape == lead + (n,) and y.dtype == np.float32
    np.testing.assert_allclose(y, want, rtol=0, atol=4e-6 * np.sqrt(k) * 8)
    rows = x.reshape(-1, k)
    alone = np.concatenate([np.asarray(product(rows[i:i + 1], w)) for i in range(len(rows))])
    np.testing.assert_array_equal(alone, y.reshape(-1, n))


def test_the_bfloat16_kernel_runs_only_where_it_applies(bf16_kernel):
    def calls(x, w, **lower):
        text = jax.jit(cpu_matmul.matmul).trace(x, w).lower(**lower).as_text()
        return text.count(f"@{bf16_kernel.targets[0]}(")

    bf16 = functools.partial(jnp.ones, dtype=jnp.bfloat16)
    assert calls(bf16((cpu_matmul.BF16_MAX_ROWS, 64)), bf16((64, 32))) == 1
    assert calls(bf16((cpu_matmul.BF16_MAX_ROWS + 1, 64)), bf16((64, 32))) == 0  # XLA's dot
    assert calls(bf16((2, 48)), bf16((48, 32))) == 0  # K not a multiple of 32
    assert calls(bf16((2, 64)), bf16((64, 40))) == 0  # N not a multiple of 16
    assert calls(bf16((2, 64)), bf16((64, 32)), lowering_platforms=("cuda",)) == 0
    assert not cpu_matmul.applies(bf16((2, 64)), bf16((64, 32)))  # a bfloat16 result asked
    assert cpu_matmul.matmul(bf16((2, 48)), bf16((48, 32))).dtype == jnp.float32
    x, w = (jnp.asarray(a, jnp.bfloat16) for a in _operands((3,), 64, 32, False, seed=2))
    grad = jax.grad(lambda x: jnp.sum(jnp.sin(cpu_matmul.matmul(x, w))))(x)
    want = jax.grad(lambda x: jnp.sum(jnp.sin(jnp.einsum(
        "mk,kn->mn", x, w, preferred_element_type=jnp.float32))))(x)
    np.testing.assert_allclose(np.asarray(grad, np.float32), np.asarray(want, np.float32),
                               rtol=2e-2, atol=2e-2)


@pytest.mark.skipif(cpu_matmul.bfloat16_kernel() is None, reason="no bfloat16 kernel here")
def test_each_bfloat16_kernel_has_its_switch():
    chosen = cpu_matmul.bfloat16_kernel()
    env = dict(os.environ, **{chosen.switch: "0"})
    off = subprocess.run([sys.executable, "-c", "from dspark_jax.models import cpu_matmul; "
                          "k = cpu_matmul.bfloat16_kernel(); "
                          "print(k and k.source, cpu_matmul.available())"],
                         env=env, capture_output=True, text=True, check=True)
    other = cpu_matmul.AVX512_BF16 if chosen is cpu_matmul.AMX else None
    expected = other.source if other and cpu_matmul.supported(other) else "None"
    assert off.stdout.split() == [expected, "True"]


def _reads_the_indexed_layer_in_place(dtype, target, transpose_w):
    rng = np.random.default_rng(5)
    shape = (48, 64) if transpose_w else (64, 48)
    layers = tuple(jnp.asarray(rng.standard_normal(shape), dtype) for _ in range(5))
    x = jnp.asarray(rng.standard_normal((3, 64)), dtype)
    product = jax.jit(lambda x, i: cpu_matmul.layer_matmul(x, layers, i, transpose_w))
    for i in range(len(layers)):
        np.testing.assert_array_equal(product(x, i), cpu_matmul.matmul(x, layers[i], transpose_w))
    with pytest.raises(Exception, match="layer index is out of range"):
        product(x, len(layers)).block_until_ready()
    for platform, calls in (("cpu", 1), ("cuda", 0)):  # elsewhere: a switch over einsums
        text = product.trace(x, 0).lower(lowering_platforms=(platform,)).as_text()
        assert text.count(f"@{target}(") == calls


@pytest.mark.parametrize("transpose_w", [False, True], ids=["w[K,N]", "w[N,K]"])
def test_a_layer_matmul_reads_the_indexed_layer_in_place(transpose_w):
    _reads_the_indexed_layer_in_place(jnp.float32, cpu_matmul.LAYER_TARGETS[transpose_w],
                                      transpose_w)


@pytest.mark.parametrize("transpose_w", [False, True], ids=["w[K,N]", "w[N,K]"])
def test_a_bfloat16_layer_matmul_reads_the_indexed_layer_in_place(bf16_kernel, transpose_w):
    _reads_the_indexed_layer_in_place(jnp.bfloat16, bf16_kernel.targets[2 + transpose_w],
                                      transpose_w)
