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

bfloat16 rows by bfloat16 weights with a float32 result (``layer_weights.with_dtype``'s
weights) take ``cpu_matmul_amx.cc`` on CPUs with AMX (Sapphire Rapids and later, Linux): the
tile unit multiplies up to 16 rows for the cost of reading the matrix once, where the AVX-512
multiply-adds of a float32 product of 8 rows already bind a 2-core machine, and batches of up
to 64 rows about as fast as XLA's bfloat16 dot, the LM head faster (:func:`bfloat16_kernel`;
off with ``DSPARK_JAX_CPU_AMX=0``). Its float32 sums are the tile unit's, in another order than
XLA's bfloat16 dot: within bfloat16's tolerance, and a row's bits again do not depend on the
other rows, so a token gets the same bits in a batch of any size up to 64 rows. On CPUs with
AVX-512 BF16 but no AMX (AMD Zen 4 and later), where XLA:CPU's bfloat16 dot runs below its
float32 one, they take ``cpu_matmul_bf16.cc`` instead (pair dot products, VDPBF16PS; off with
``DSPARK_JAX_CPU_BF16=0``), with the same guarantees and its own sums.
"""

from __future__ import annotations

import functools
import math
import os
from pathlib import Path
from typing import NamedTuple

import jax
import jax.numpy as jnp

from dspark_jax.models import cpu_kernels

SOURCE = Path(__file__).with_name("cpu_matmul.cc")
TARGETS = {False: "dspark_small_matmul", True: "dspark_small_matmul_t"}  # by transpose_w
ROW_SUM_TARGET = "dspark_row_sum"
LAYER_TARGETS = {False: "dspark_layer_matmul", True: "dspark_layer_matmul_t"}  # layers[index]


class Bfloat16Kernel(NamedTuple):
    """A kernel for bfloat16 rows by bfloat16 weights with a float32 result: its source beside
    this module, its FFI targets (x @ w, x @ w^T, x @ layers[index], x @ layers[index]^T) and
    their handler symbols,
    the compiler flags and CPU flags it needs, and the environment variable that switches it
    off."""
    source: str
    targets: tuple[str, str, str, str]
    symbols: tuple[str, str, str, str]
    flags: tuple[str, ...]
    cpu_flags: tuple[str, ...]
    switch: str


AMX = Bfloat16Kernel(
    "cpu_matmul_amx.cc",
    ("dspark_small_matmul_amx", "dspark_small_matmul_amx_t", "dspark_layer_matmul_amx",
     "dspark_layer_matmul_amx_t"),
    ("DsparkSmallMatmulAmx", "DsparkSmallMatmulAmxT", "DsparkLayerMatmulAmx",
     "DsparkLayerMatmulAmxT"),
    ("-mavx512bw", "-mamx-tile", "-mamx-bf16"), ("avx512bw", "amx_tile", "amx_bf16"),
    "DSPARK_JAX_CPU_AMX")
AVX512_BF16 = Bfloat16Kernel(
    "cpu_matmul_bf16.cc",
    ("dspark_small_matmul_bf16", "dspark_small_matmul_bf16_t", "dspark_layer_matmul_bf16",
     "dspark_layer_matmul_bf16_t"),
    ("DsparkSmallMatmulBf16", "DsparkSmallMatmulBf16T", "DsparkLayerMatmulBf16",
     "DsparkLayerMatmulBf16T"),
    ("-mavx512bw", "-mavx512bf16"), ("avx512bw", "avx512_bf16"), "DSPARK_JAX_CPU_BF16")
MAX_ROWS = 32  # the most rows (tokens times batch rows) of a float32 product by the kernel
# ... of a bfloat16 one: beyond, XLA's dot is as fast on AMX (benchmarks/bf16_rows.py)
BF16_MAX_ROWS = 64
BF16_K, BF16_N = 32, 16  # the bfloat16 kernels' contraction and output sizes are multiples of these


@functools.cache
def available() -> bool:
    """Whether :func:`matmul` runs the kernel on CPU here (built and registered on the first
    call): ``cpu_kernels.usable`` (AVX-512, the CPU as JAX's default backend,
    ``DSPARK_JAX_CPU_MATMUL`` not "0") and the kernel built (a C++ compiler)."""
    what = "float32 matmuls"
    return (cpu_kernels.usable("DSPARK_JAX_CPU_MATMUL", what)
            and cpu_kernels.register(SOURCE, {TARGETS[False]: "DsparkSmallMatmul",
                                              TARGETS[True]: "DsparkSmallMatmulT",
                                              ROW_SUM_TARGET: "DsparkRowSum",
                                              LAYER_TARGETS[False]: "DsparkLayerMatmul",
                                              LAYER_TARGETS[True]: "DsparkLayerMatmulT"}, what))


@functools.cache
def supported(kernel: Bfloat16Kernel) -> bool:
    """Whether the bfloat16 ``kernel`` can run here (built and registered on the first call):
    ``cpu_kernels.usable``, the CPU flags it needs (for :data:`AMX` also the process allowed
    the tile state, ``cpu_kernels.allow_amx``) and the kernel built."""
    what = "bfloat16 matmuls"
    return (cpu_kernels.usable("DSPARK_JAX_CPU_MATMUL", what)
            and cpu_kernels.has_cpu_flags(*kernel.cpu_flags)
            and (kernel is not AMX or cpu_kernels.allow_amx())
            and cpu_kernels.register(Path(__file__).with_name(kernel.source),
                                     dict(zip(kernel.targets, kernel.symbols)), what,
                                     kernel.flags))


@functools.cache
def bfloat16_kernel() -> Bfloat16Kernel | None:
    """The kernel that :func:`matmul` runs for bfloat16 operands here, or None: :data:`AMX`
    where it is :func:`supported`, else :data:`AVX512_BF16` (a CPU with AVX-512 BF16 and no
    AMX), each unless its switch (``DSPARK_JAX_CPU_AMX``, ``DSPARK_JAX_CPU_BF16``) is "0"."""
    return next((kernel for kernel in (AMX, AVX512_BF16)
                 if os.environ.get(kernel.switch, "1") != "0" and supported(kernel)), None)


def _einsum(x: jax.Array, w: jax.Array, transpose_w: bool) -> jax.Array:
    return jnp.einsum("...i,oi->...o" if transpose_w else "...i,io->...o", x, w,
                      preferred_element_type=jnp.float32)


def _kernel(x: jax.Array, w: jax.Array, transpose_w: bool) -> jax.Array:
    out = jax.ShapeDtypeStruct(x.shape[:-1] + (w.shape[0] if transpose_w else w.shape[1],),
                               jnp.float32)
    target = (TARGETS[transpose_w] if x.dtype == jnp.float32
              else bfloat16_kernel().targets[transpose_w])
    return jax.ffi.ffi_call(target, out, vmap_method="sequential")(x, w)


def applies(x: jax.Array, w: jax.Array, preferred_element_type=None,
            transpose_w: bool = False) -> bool:
    """Whether :func:`matmul` of x [..., K] by w (``transpose_w``: w [N, K]) runs a kernel on
    CPU: either both float32 with no other result dtype asked and at most :data:`MAX_ROWS`
    rows (:func:`available`), or both bfloat16 with a float32 result asked, at most
    :data:`BF16_MAX_ROWS` rows, K a multiple of :data:`BF16_K` and N of :data:`BF16_N`
    (:func:`bfloat16_kernel`)."""
    rows = math.prod(x.shape[:-1])
    if w.ndim != 2 or rows == 0:
        return False
    if x.dtype == jnp.float32 and w.dtype == jnp.float32:
        return (rows <= MAX_ROWS and preferred_element_type in (None, jnp.float32)
                and available())
    n = w.shape[0] if transpose_w else w.shape[1]
    return (x.dtype == jnp.bfloat16 and w.dtype == jnp.bfloat16 and rows <= BF16_MAX_ROWS
            and preferred_element_type == jnp.float32 and x.shape[-1] % BF16_K == 0
            and n % BF16_N == 0 and bfloat16_kernel() is not None)


@functools.partial(jax.custom_jvp, nondiff_argnums=(2,))
def _product(x: jax.Array, w: jax.Array, transpose_w: bool) -> jax.Array:
    return jax.lax.platform_dependent(x, w, cpu=functools.partial(_kernel, transpose_w=transpose_w),
                                      default=functools.partial(_einsum, transpose_w=transpose_w))


@_product.defjvp
def _product_jvp(transpose_w, primals, tangents):
    (x, w), (dx, dw) = primals, tangents  # the tangents are einsums: linear, transposable
    return (_product(x, w, transpose_w),
            _einsum(dx, w, transpose_w) + _einsum(x, dw, transpose_w))


@jax.custom_jvp
def _row_sum(x: jax.Array) -> jax.Array:
    def kernel(x):
        out = jax.ShapeDtypeStruct(x.shape[:-1], jnp.float32)
        return jax.ffi.ffi_call(ROW_SUM_TARGET, out, vmap_method="sequential")(x)

    return jax.lax.platform_dependent(x, cpu=kernel, default=lambda x: jnp.sum(x, axis=-1))


@_row_sum.defjvp
def _row_sum_jvp(primals, tangents):
    return _row_sum(*primals), jnp.sum(tangents[0], axis=-1)  # linear, transposable


def row_sum(x: jax.Array) -> jax.Array:
    """x [..., K] -> [...], each row's sum over its last axis. Where the kernel runs (float32,
    the CPU, no mesh of several devices: a custom call has no sharding rule), for any number
    of rows, each row added up in order from +0 (the bits of x times a column of ones by
    :func:`matmul`'s kernel), 16 rows at a time: a row's sum has the same bits whatever the
    other rows (XLA:CPU's reduction sums a row in another order when it has 8 rows than when
    it has one). ``jnp.sum`` otherwise, and on any other platform the program is lowered for.
    Differentiable."""
    if not (x.dtype == jnp.float32 and x.ndim and x.size and cpu_kernels.unsharded()
            and available()):
        return jnp.sum(x, axis=-1)
    return _row_sum(x)


def matmul(x: jax.Array, w: jax.Array, transpose_w: bool = False) -> jax.Array:
    """x [..., K] @ w [K, N] -> float32 [..., N] (``transpose_w``: w [N, K], e.g. an embedding
    table as the LM head), x and w both float32 or both bfloat16: a kernel on CPU where
    :func:`applies`, ``jnp.einsum`` with a float32 result otherwise (and on any other platform
    the program is lowered for). Differentiable (by einsums)."""
    if not applies(x, w, jnp.float32, transpose_w):
        return _einsum(x, w, transpose_w)
    return _product(x, w, transpose_w)


def layer_matmul(x: jax.Array, layers: tuple[jax.Array, ...], index: jax.Array,
                 transpose_w: bool = False) -> jax.Array:
    """x [..., K] @ layers[index] [K, N] (``transpose_w``: layers[index] [N, K]) -> float32
    [..., N] inside a scan over layers, where :func:`applies` to x and the layers (one shape
    and dtype): one custom call that takes every layer's array and the traced ``index`` and
    reads the chosen matrix in place, without the conditional over the layers (``lax.switch``)
    that XLA:CPU would run around each matmul. Other platforms lower a switch over einsums.
    Not differentiable (the engine's per-layer arrays, ``layer_weights.Unstacked``, are an
    inference layout)."""
    def kernel(x, index, *layers):
        n = layers[0].shape[0] if transpose_w else layers[0].shape[1]
        out = jax.ShapeDtypeStruct(x.shape[:-1] + (n,), jnp.float32)
        target = (LAYER_TARGETS[transpose_w] if x.dtype == jnp.float32
                  else bfloat16_kernel().targets[2 + transpose_w])
        return jax.ffi.ffi_call(target, out, vmap_method="sequential")(
            x, index, *layers)

    def switch(x, index, *layers):
        return jax.lax.switch(index, [functools.partial(_einsum, w=w, transpose_w=transpose_w)
                                      for w in layers], x)

    return jax.lax.platform_dependent(x, jnp.asarray(index, jnp.int32), *layers, cpu=kernel,
                                      default=switch)
