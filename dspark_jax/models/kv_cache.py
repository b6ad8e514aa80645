"""The key/value cache as an explicit pytree.

Slot ``s`` of a row holds the keys and values of the token at position ``s`` of that row, so a
cache needs no length field for attention: a query at position p sees slots 0..p, which are
always committed tokens. Rolling back after a rejected draft is therefore free; the next write
at the committed length overwrites the stale slots (as in levanter's speculative loop).

The layout is [layers, rows, kv heads, slots, head dim]: each (row, head) holds its slots as one
contiguous [S, D] matrix, the operand layout of the attention's batched matmuls, so XLA reads
the cache in place instead of first copying it into a transposed layout (on CPU that copy took
about a sixth of a decode step: benchmarks/profile_decode.py, BENCHMARKS.md).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from dspark_jax import sharding


@struct.dataclass
class KVCache:
    """k, v: [L, B, K, S, D] for L layers, B rows, K kv heads, S slots, D head dim."""

    k: jax.Array
    v: jax.Array

    @classmethod
    def zeros(cls, num_layers: int, batch: int, slots: int, kv_heads: int, head_dim: int,
              dtype) -> "KVCache":
        """An empty cache, laid out by :meth:`constrain`.

        k and v are separate buffers, so the cache can be donated to a jitted function."""
        shape = (num_layers, batch, kv_heads, slots, head_dim)
        return cls(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype)).constrain()

    def constrain(self) -> "KVCache":
        """Inside jit under a mesh: rows sharded over the data axes, kv heads over the tensor
        axis (a no-op without a mesh)."""
        names = (None, "batch", "kv_heads", None, None)
        return KVCache(sharding.constrain(self.k, names), sharding.constrain(self.v, names))

    @property
    def num_slots(self) -> int:
        return self.k.shape[3]

    def write(self, k_new: jax.Array, v_new: jax.Array, positions: jax.Array,
              rows: jax.Array | None = None) -> "KVCache":
        """Scatters new entries of every layer: k_new, v_new [L, B, T, K, D] (token-major, as
        the layers compute them) at slots ``positions`` int [B, T] of cache rows ``rows`` int [B]
        (default 0..B-1); positions >= S and rows beyond the cache are dropped. In place inside
        a loop carry."""
        if rows is None:
            rows = jnp.arange(positions.shape[0])
        rows = rows[:, None]

        def put(cache, new):  # the indexed dims [B, T] lead the update: [B, T, L, K, D]
            return cache.at[:, rows, :, positions].set(
                jnp.moveaxis(new, 0, 2).astype(cache.dtype), mode="drop")

        return KVCache(put(self.k, k_new), put(self.v, v_new))

    def set_rows(self, new: "KVCache", rows: jax.Array) -> "KVCache":
        """Replaces whole rows: ``new`` k/v [L, B, K, S, D] into cache rows ``rows`` int [B]
        (rows beyond the cache are dropped)."""
        return KVCache(*(full.at[:, rows].set(part.astype(full.dtype), mode="drop")
                         for full, part in ((self.k, new.k), (self.v, new.v))))


def write_layer(cache_layer: jax.Array, new: jax.Array, positions: jax.Array) -> jax.Array:
    """Scatters new entries into one layer of the cache.

    Args:
      cache_layer: [B, K, S, D].
      new: [B, T, K, D], the entries of the tokens at ``positions``.
      positions: int [B, T], slot of each new token (positions >= S are dropped).

    Returns:
      [B, K, S, D] updated.
    """
    rows = jnp.arange(new.shape[0])[:, None]
    return cache_layer.at[rows, :, positions].set(new.astype(cache_layer.dtype), mode="drop")
