"""The full-vocabulary part of the training loss on x86 CPUs: ``cpu_vocab_loss.cc``.

Between a chunk's logits matmuls, :func:`losses.vocab_loss` needs each slot's cross-entropy,
the L1 distance between the draft and target softmaxes, and the gradient of the weighted sum
with respect to the draft logits. XLA:CPU computes that as a dozen passes over [n, V] float32
arrays and sums their rows with a scalar loop (BENCHMARKS.md, issue 18); the kernel passes over
one slot's two rows at a time while they stay in a core's cache, on XLA's intra-op threads.

:func:`slot_terms_and_gradient` runs it on CPU where :func:`applies` (built on first use by
``models.cpu_kernels``; off with ``DSPARK_JAX_CPU_LOSS=0``) and lowers the jnp formulation for
other platforms (``lax.platform_dependent``), which is also its definition: the two agree to
float32 rounding (tests/training/test_cpu_vocab_loss.py).
"""

from __future__ import annotations

import functools
from pathlib import Path

import jax
import jax.numpy as jnp

from dspark_jax.models import cpu_kernels

SOURCE = Path(__file__).with_name("cpu_vocab_loss.cc")
TARGET = "dspark_vocab_loss"


@functools.cache
def available() -> bool:
    """Whether the kernel runs on CPU here (built and registered on the first call):
    ``cpu_kernels.usable`` (AVX-512, the CPU as JAX's default backend, ``DSPARK_JAX_CPU_LOSS``
    not "0") and the kernel built (a C++ compiler)."""
    what = "the loss's vocabulary terms"
    return (cpu_kernels.usable("DSPARK_JAX_CPU_LOSS", what)
            and cpu_kernels.register(SOURCE, {TARGET: "DsparkVocabLoss"}, what))


def reference(z: jax.Array, t: jax.Array, labels: jax.Array, c_ce: jax.Array,
              c_l1: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The definition, in jnp: see :func:`slot_terms_and_gradient`."""
    log_p = jax.nn.log_softmax(z, axis=-1)
    p = jnp.exp(log_p)
    ce = -jnp.take_along_axis(log_p, labels[:, None], axis=-1)[:, 0]
    diff = p - jax.nn.softmax(t, axis=-1)
    l1 = jnp.sum(jnp.abs(diff), axis=-1)
    # d ce / dz = p - onehot(label); d l1 / dz = p * (s - <p, s>) with s = sign(p - q).
    sign = jnp.sign(diff)
    onehot = jax.nn.one_hot(labels, z.shape[-1], dtype=jnp.float32)
    g = (c_ce[:, None] * (p - onehot)
         + c_l1[:, None] * p * (sign - jnp.sum(p * sign, axis=-1, keepdims=True)))
    return g, ce, l1


def _kernel(z, t, labels, c_ce, c_l1):
    n, v = z.shape
    out = (jax.ShapeDtypeStruct((n, v), jnp.float32), jax.ShapeDtypeStruct((n,), jnp.float32),
           jax.ShapeDtypeStruct((n,), jnp.float32))
    return tuple(jax.ffi.ffi_call(TARGET, out, vmap_method="sequential")(
        z, t, labels.astype(jnp.int32), c_ce, c_l1))


def applies(z: jax.Array, t: jax.Array) -> bool:
    """Whether :func:`slot_terms_and_gradient` takes the kernel for these logits: both float32
    [n, V] with n, V > 0, no mesh of several devices (a custom call has no sharding rule) and
    the kernel available."""
    return (z.dtype == jnp.float32 and t.dtype == jnp.float32 and z.ndim == 2
            and z.shape == t.shape and z.size > 0 and cpu_kernels.unsharded() and available())


def slot_terms_and_gradient(z: jax.Array, t: jax.Array, labels: jax.Array, c_ce: jax.Array,
                            c_l1: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Each slot's loss terms and the gradient of sum_n c_ce[n] CE[n] + c_l1[n] L1[n].

    Args:
      z: float32 [n, V] draft logits (with the sequential head's bias); t: float32 [n, V] the
        target's logits at the same slots; labels: int [n] in [0, V); c_ce, c_l1: float32 [n].

    Returns:
      (g [n, V] the gradient with respect to z, ce [n] = -log softmax(z)[label],
      l1 [n] = sum_v |softmax(z) - softmax(t)|), all float32; values only (no autodiff rule:
      ``losses.vocab_loss`` is the differentiable function).
    """
    if not applies(z, t):
        return reference(z, t, labels, c_ce, c_l1)
    return jax.lax.platform_dependent(z, t, labels, c_ce, c_l1, cpu=_kernel, default=reference)
