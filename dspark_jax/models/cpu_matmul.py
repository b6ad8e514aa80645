"""A float32 product of a few rows by a weight matrix on x86 CPUs: ``cpu_matmul.cc``.

XLA:CPU multiplies 2 to 32 float32 rows by a matrix at a fraction of the memory's speed, so
on a 2-core Xeon a verify of 8 tokens cost 1.9 decode steps of SmolLM2-135M (BENCHMARKS.md,
issue 19). ``cpu_matmul.cc`` reads the matrix once for all rows, through XLA's own thread pool,
as an XLA FFI custom call: 8 rows through SmolLM2's layer matrices cost 1.15-1.7x one row,
against 1.6-2.6x with XLA's dot (BENCHMARKS.md, "A few-row float32 matmul kernel"). Every result
element is computed by the same instructions in the same order whatever the number of rows, so
a token's product in a verify has the bits of the same token's product in a decode step.

:func:`matmul` uses it on CPU when the host has AVX-512 and a C++ compiler (``$CXX``, else
``c++``): the kernel is compiled on first use into :func:`storage.cache_dir` (a few seconds,
once per source and jaxlib version) and registered with XLA. Elsewhere (other platforms under
``lax.platform_dependent``, no AVX-512, no compiler, ``DSPARK_JAX_CPU_MATMUL=0``) the product
is ``jnp.einsum``. The layer scans' matmuls over per-layer arrays (``layer_weights``) and the
LM heads (``Decoder.logits``) of a float32 model take this path.
"""

from __future__ import annotations

import functools
import math
from pathlib import Path

import jax
import jax.numpy as jnp

from dspark_jax.models import cpu_kernels

SOURCE = Path(__file__).with_name("cpu_matmul.cc")
TARGETS = {False: "dspark_small_matmul", True: "dspark_small_matmul_t"}  # by transpose_w
MAX_ROWS = 32  # the most rows (tokens times batch rows) multiplied by the kernel


@functools.cache
def available() -> bool:
    """Whether :func:`matmul` runs the kernel on CPU here (built and registered on the first
    call): ``cpu_kernels.usable`` (AVX-512, the CPU as JAX's default backend,
    ``DSPARK_JAX_CPU_MATMUL`` not "0") and the kernel built (a C++ compiler)."""
    what = "float32 matmuls"
    return (cpu_kernels.usable("DSPARK_JAX_CPU_MATMUL", what)
            and cpu_kernels.register(SOURCE, {TARGETS[False]: "DsparkSmallMatmul",
                                              TARGETS[True]: "DsparkSmallMatmulT"}, what))


def _einsum(x: jax.Array, w: jax.Array, transpose_w: bool) -> jax.Array:
    return jnp.einsum("...i,oi->...o" if transpose_w else "...i,io->...o", x, w)


def _kernel(x: jax.Array, w: jax.Array, transpose_w: bool) -> jax.Array:
    out = jax.ShapeDtypeStruct(x.shape[:-1] + (w.shape[0] if transpose_w else w.shape[1],),
                               jnp.float32)
    return jax.ffi.ffi_call(TARGETS[transpose_w], out, vmap_method="sequential")(x, w)


def applies(x: jax.Array, w: jax.Array, preferred_element_type=None) -> bool:
    """Whether :func:`matmul` of x [..., K] by w runs the kernel on CPU: both float32, at
    most :data:`MAX_ROWS` rows, no other result dtype asked, the kernel available."""
    rows = math.prod(x.shape[:-1])
    return (x.dtype == jnp.float32 and w.dtype == jnp.float32 and w.ndim == 2
            and preferred_element_type in (None, jnp.float32) and 0 < rows <= MAX_ROWS
            and available())


@functools.partial(jax.custom_jvp, nondiff_argnums=(2,))
def _product(x: jax.Array, w: jax.Array, transpose_w: bool) -> jax.Array:
    return jax.lax.platform_dependent(x, w, cpu=functools.partial(_kernel, transpose_w=transpose_w),
                                      default=functools.partial(_einsum, transpose_w=transpose_w))


@_product.defjvp
def _product_jvp(transpose_w, primals, tangents):
    (x, w), (dx, dw) = primals, tangents  # the tangents are einsums: linear, transposable
    return (_product(x, w, transpose_w),
            _einsum(dx, w, transpose_w) + _einsum(x, dw, transpose_w))


def row_sum(x: jax.Array) -> jax.Array:
    """x [..., K] -> [...], each row's sum over its last axis. Where the kernel runs (float32,
    the CPU, no mesh of several devices: a custom call has no sharding rule), for any number
    of rows, as x times a column of ones: one fused multiply-add chain per row in order, so a
    row's sum has the same bits whatever the other rows (XLA:CPU's reduction sums a row in
    another order when it has 8 rows than when it has one). ``jnp.sum`` otherwise, and on any
    other platform the program is lowered for. Differentiable."""
    if not (x.dtype == jnp.float32 and x.ndim and x.size and cpu_kernels.unsharded()
            and available()):
        return jnp.sum(x, axis=-1)
    return _product(x, jnp.ones((x.shape[-1], 1), x.dtype), False)[..., 0]


def matmul(x: jax.Array, w: jax.Array, transpose_w: bool = False) -> jax.Array:
    """x [..., K] @ w [K, N] -> [..., N] (``transpose_w``: w [N, K], e.g. an embedding table as
    the LM head), float32: the kernel on CPU where :func:`applies`, ``jnp.einsum`` otherwise
    (and on any other platform the program is lowered for). Differentiable (by einsums)."""
    if not applies(x, w):
        return _einsum(x, w, transpose_w)
    return _product(x, w, transpose_w)
