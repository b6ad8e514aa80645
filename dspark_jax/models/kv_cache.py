"""The key/value cache as an explicit pytree.

Slot ``s`` of a row holds the keys and values of the token at position ``s`` of that row, so a
cache needs no length field for attention: a query at position p sees slots 0..p, which are
always committed tokens. Rolling back after a rejected draft is therefore free; the next write
at the committed length overwrites the stale slots (as in levanter's speculative loop).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from dspark_jax import sharding


@struct.dataclass
class KVCache:
    """k, v: [L, B, S, K, D] for L layers, B rows, S slots, K kv heads, D head dim."""

    k: jax.Array
    v: jax.Array

    @classmethod
    def zeros(cls, num_layers: int, batch: int, slots: int, kv_heads: int, head_dim: int,
              dtype) -> "KVCache":
        """An empty cache, laid out by :meth:`constrain`.

        k and v are separate buffers, so the cache can be donated to a jitted function."""
        shape = (num_layers, batch, slots, kv_heads, head_dim)
        return cls(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype)).constrain()

    def constrain(self) -> "KVCache":
        """Inside jit under a mesh: rows sharded over the data axes, kv heads over the tensor
        axis (a no-op without a mesh)."""
        names = (None, "batch", None, "kv_heads", None)
        return KVCache(sharding.constrain(self.k, names), sharding.constrain(self.v, names))

    @property
    def num_slots(self) -> int:
        return self.k.shape[2]

    def write(self, k_new: jax.Array, v_new: jax.Array, positions: jax.Array) -> "KVCache":
        """Scatters new entries of every layer: k_new, v_new [L, B, T, K, D] at slots
        ``positions`` int [B, T] (positions >= S are dropped); in place inside a loop carry."""
        rows = jnp.arange(positions.shape[0])[:, None]
        return KVCache(self.k.at[:, rows, positions].set(k_new.astype(self.k.dtype), mode="drop"),
                       self.v.at[:, rows, positions].set(v_new.astype(self.v.dtype), mode="drop"))


def write_layer(cache_layer: jax.Array, new: jax.Array, positions: jax.Array) -> jax.Array:
    """Scatters new entries into one layer of the cache.

    Args:
      cache_layer: [B, S, K, D].
      new: [B, T, K, D], the entries of the tokens at ``positions``.
      positions: int [B, T], slot of each new token (positions >= S are dropped).

    Returns:
      [B, S, K, D] updated.
    """
    rows = jnp.arange(new.shape[0])[:, None]
    return cache_layer.at[rows, positions].set(new.astype(cache_layer.dtype), mode="drop")
