"""Attention over one layer of a stacked float32 KV cache, and a prefill's attention within
its rows, on x86 CPUs: ``cpu_attention.cc``.

A decode or verify step on XLA:CPU copies each layer's cache out of the stacked arrays (the
layer scan's dynamic slice) and reads every slot of the step's view in two batched matmuls,
committed or not. ``cpu_attention.cc`` takes the whole stacked cache and the layer's index
(an XLA FFI custom call reads its operands in place) and reads only each row's committed slots,
on XLA's intra-op threads (BENCHMARKS.md, "Attention over the cache in place"). A query's
result depends only on the keys it sees, computed in one fixed order: a token's attention in a
verify has the bits of its attention in a decode step.

:func:`attend` runs it on CPU where :func:`applies` (built on first use by ``cpu_kernels``;
off with ``DSPARK_JAX_CPU_ATTENTION=0``) and lowers the caller's other implementation for
other platforms (``lax.platform_dependent``). ``fused_attention.attend_cache`` chooses it as
the "cpu" cache implementation, the default where it is available.

:func:`attend_rows` is a prefill's causal attention within each row (no cache), by the same
chains: the einsum stores [B, K, G, T, T] score blocks and passes over them five times (about
70% of a 64-row prefill of 256-token prompts, BENCHMARKS.md); the kernel scores a block of
queries at a time in a scratch that stays in the CPU's caches, and without a window a token's
attention has the bits of the cache kernel's for it over the same keys and values.
``fused_attention.attend_segments`` runs it as the "cpu" implementation.
"""

from __future__ import annotations

import functools
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from dspark_jax.models import cpu_kernels

SOURCE = Path(__file__).with_name("cpu_attention.cc")
TARGET = "dspark_cached_attention"
ROW_TARGET = "dspark_row_attention"
MAX_HEAD_DIM = 256  # the kernel's accumulators: 16 vectors of 16 floats


@functools.cache
def available() -> bool:
    """Whether the kernel runs on CPU here (built and registered on the first call):
    ``cpu_kernels.usable`` (AVX-512, the CPU as JAX's default backend,
    ``DSPARK_JAX_CPU_ATTENTION`` not "0") and the kernel built (a C++ compiler)."""
    what = "cache and prefill attentions"
    return (cpu_kernels.usable("DSPARK_JAX_CPU_ATTENTION", what)
            and cpu_kernels.register(SOURCE, {TARGET: "DsparkCachedAttention",
                                              ROW_TARGET: "DsparkRowAttention"}, what))


def applies(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, k_new: jax.Array,
            v_new: jax.Array, transposed_keys: bool) -> bool:
    """Whether :func:`attend` takes these operands: all float32, keys stacked [L, B, K, D, N]
    (``transposed_keys``, the CPU's layout), a head dim that is a multiple of 16 up to
    :data:`MAX_HEAD_DIM`, no mesh of several devices (a custom call has no sharding rule: XLA
    would gather the cache to every device; the einsum is partitioned), and the kernel
    available."""
    d = q.shape[-1]
    return (transposed_keys and k_cache.ndim == 5 and d % 16 == 0 and d <= MAX_HEAD_DIM
            and all(x.dtype == jnp.float32 for x in (q, k_cache, v_cache, k_new, v_new))
            and cpu_kernels.unsharded() and available())


def _kernel(q, k_cache, v_cache, layer, lengths, k_new, v_new, new_visible, *, scale: float):
    call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct(q.shape, jnp.float32),
                            vmap_method="sequential")
    return call(q, k_cache, v_cache, jnp.asarray(layer, jnp.int32), lengths.astype(jnp.int32),
                k_new, v_new, new_visible.astype(jnp.bool_), scale=np.float32(scale))


def attend(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, layer: jax.Array,
           lengths: jax.Array, k_new: jax.Array, v_new: jax.Array, new_visible: jax.Array, *,
           scale: float, otherwise) -> jax.Array:
    """Attention of T new tokens per row over layer ``layer`` of a stacked cache and over
    each other (the kernel on CPU; check :func:`applies` first).

    Args:
      q: [B, T, H, D] queries of the new tokens.
      k_cache, v_cache: the whole stacked cache, keys [L, B, K, D, N] and values
        [L, B, K, N, D] (kv_cache.py's CPU layout); layer: int [], the layer read.
      lengths: int [B]; every query of row b sees the slots < lengths[b] (clipped to N).
      k_new, v_new: [B, T, K, D] the new tokens' keys / values; new_visible: bool [B, T, T].
      scale: the scores' scale.
      otherwise: the same attention by other means, ``otherwise(q, k_cache, ..., new_visible)``
        with this function's positional arguments, lowered for any other platform.

    Returns:
      [B, T, H, D] float32; a query with no visible key gets zeros.
    """
    return jax.lax.platform_dependent(q, k_cache, v_cache, layer, lengths, k_new, v_new,
                                      new_visible, cpu=functools.partial(_kernel, scale=scale),
                                      default=otherwise)


def applies_rows(q: jax.Array, k: jax.Array, v: jax.Array) -> bool:
    """Whether :func:`attend_rows` takes these operands: all float32, a head dim that is a
    multiple of 16 up to :data:`MAX_HEAD_DIM`, no mesh of several devices, the kernel
    available."""
    d = q.shape[-1]
    return (d % 16 == 0 and d <= MAX_HEAD_DIM and all(x.dtype == jnp.float32 for x in (q, k, v))
            and cpu_kernels.unsharded() and available())


def _row_kernel(q, k, v, lengths, *, scale: float, window: int):
    call = jax.ffi.ffi_call(ROW_TARGET, jax.ShapeDtypeStruct(q.shape, jnp.float32),
                            vmap_method="sequential")
    return call(q, k, v, lengths.astype(jnp.int32), scale=np.float32(scale),
                window=np.int64(window))


def attend_rows(q: jax.Array, k: jax.Array, v: jax.Array, lengths: jax.Array, *, scale: float,
                window: int | None, otherwise) -> jax.Array:
    """Causal attention of each row's first ``lengths[b]`` tokens among themselves (a
    prefill; the kernel on CPU: check :func:`applies_rows` first).

    Args:
      q: [B, T, H, D]; k, v: [B, T, K, D] with H a multiple of K.
      lengths: int [B]; token t of row b sees the tokens u <= t of the row (u > t - window
        with a window); tokens t >= lengths[b] are padding and get zeros.
      scale: the scores' scale; window: static, None for none.
      otherwise: the same attention by other means, ``otherwise(q, k, v, lengths)``, lowered
        for any other platform.

    Returns:
      [B, T, H, D] float32.
    """
    if window is not None and window <= 0:
        raise ValueError(f"a sliding window of {window} tokens: positive, or None for none")
    kernel = functools.partial(_row_kernel, scale=scale, window=window or 0)
    return jax.lax.platform_dependent(q, k, v, lengths, cpu=kernel, default=otherwise)
