"""The key/value cache as an explicit pytree.

Slot ``s`` of a row holds the keys and values of the token at position ``s`` of that row, so a
cache needs no length field for attention: a query at position p sees slots 0..p, which are
always committed tokens. Rolling back after a rejected draft is therefore free; the next write
at the committed length overwrites the stale slots (as in levanter's speculative loop).

The layout is that of the attention's two batched matmuls, so XLA reads the cache in place
instead of first copying it into another layout (on CPU that copy took about a sixth of a decode
step: benchmarks/profile_decode.py, BENCHMARKS.md): values are [layers, rows, kv heads, slots,
head dim], each (row, head) an [S, D] matrix, the right operand of weights [Q, S] @ values.
Keys depend on the backend (``transposed_keys``):

* on a CPU [layers, rows, kv heads, head dim, slots], an [D, S] matrix, the right operand of
  queries [Q, D] @ keys. With keys stored [S, D] the score matmul contracts both operands on
  their minor dimension, which XLA:CPU ran 3-4x slower than [Q, D] @ [D, S] at batch 32
  (BENCHMARKS.md, issue 19);
* on accelerators [layers, rows, kv heads, slots, head dim], the values' layout, which the
  decode kernels read (``fused_attention.attend_cache``: a head's keys stream slot by slot).

A model whose layers come in groups of different shapes (Gemma4: sliding layers with
``head_dim`` and full layers with ``global_head_dim``; ``model_config.layer_groups``) keeps one
such pair of arrays per group: ``k`` and ``v`` are then tuples, the group's layers in order, and
every method works group by group.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import struct

from dspark_jax import sharding
from dspark_jax.model_config import attention_dims, layer_groups


def default_transposed_keys() -> bool:
    """Keys [..., D, S] on a CPU, [..., S, D] (the values' layout) on accelerators."""
    return jax.default_backend() == "cpu"


@struct.dataclass
class KVCache:
    """k: [L, B, K, D, S] (``transposed_keys``) or [L, B, K, S, D], and v: [L, B, K, S, D] for
    L layers, B rows, K kv heads, D head dim, S slots (or tuples of them, one per layer group)."""

    k: jax.Array | tuple[jax.Array, ...]
    v: jax.Array | tuple[jax.Array, ...]
    transposed_keys: bool = struct.field(pytree_node=False)

    @classmethod
    def for_model(cls, cfg, batch: int, slots: int, dtype,
                  transposed_keys: bool | None = None) -> "KVCache":
        """An empty cache for a decoder config: one pair of arrays, or one per layer group."""
        groups = layer_groups(cfg)
        parts = [cls.zeros(len(ids), batch, slots, *attention_dims(cfg, cfg.layer_types[ids[0]])[:2],
                           dtype, transposed_keys) for ids in groups]
        if len(parts) == 1:
            return parts[0]
        return parts[0].replace(k=tuple(p.k for p in parts), v=tuple(p.v for p in parts))

    @classmethod
    def zeros(cls, num_layers: int, batch: int, slots: int, kv_heads: int, head_dim: int,
              dtype, transposed_keys: bool | None = None) -> "KVCache":
        """An empty cache, laid out by :meth:`constrain`; ``transposed_keys`` None: the
        backend's layout (:func:`default_transposed_keys`).

        k and v are separate buffers, so the cache can be donated to a jitted function."""
        if transposed_keys is None:
            transposed_keys = default_transposed_keys()
        shape = (num_layers, batch, kv_heads, slots, head_dim)
        keys = (num_layers, batch, kv_heads, head_dim, slots) if transposed_keys else shape
        return cls(jnp.zeros(keys, dtype), jnp.zeros(shape, dtype), transposed_keys).constrain()

    def constrain(self) -> "KVCache":
        """Inside jit under a mesh: rows sharded over the data axes, kv heads over the tensor
        axis (a no-op without a mesh)."""
        names = (None, "batch", "kv_heads", None, None)
        return jax.tree.map(lambda x: sharding.constrain(x, names), self)

    @property
    def num_slots(self) -> int:
        return jax.tree.leaves(self.v)[0].shape[3]

    @property
    def num_rows(self) -> int:
        return jax.tree.leaves(self.v)[0].shape[1]

    @property
    def dtype(self):
        return jax.tree.leaves(self.v)[0].dtype

    def write(self, k_new: jax.Array, v_new: jax.Array, positions: jax.Array,
              rows: jax.Array | None = None) -> "KVCache":
        """Scatters new entries of every layer: k_new, v_new [L, B, T, K, D] (token-major, as
        the layers compute them; tuples of them for a grouped cache) at slots ``positions``
        int [B, T] of cache rows ``rows`` int [B] (default 0..B-1); positions >= S and rows
        beyond the cache are dropped. In place inside a loop carry."""
        if rows is None:
            rows = jnp.arange(positions.shape[0])
        rows = rows[:, None]

        def put(cache, new, index):  # the indexed dims [B, T] lead the update: [B, T, L, K, D]
            return cache.at[index].set(jnp.moveaxis(new, 0, 2).astype(cache.dtype), mode="drop")

        s = slice(None)
        by_slot = (s, rows, s, positions)
        key_index = (s, rows, s, s, positions) if self.transposed_keys else by_slot
        return self.replace(k=jax.tree.map(lambda c, n: put(c, n, key_index), self.k, k_new),
                            v=jax.tree.map(lambda c, n: put(c, n, by_slot), self.v, v_new))

    def write_prefix(self, k_new: jax.Array, v_new: jax.Array, rows: jax.Array) -> "KVCache":
        """Writes the first W slots of cache rows ``rows`` int [B] (an admission's prompts,
        positions 0 .. W-1; rows beyond the cache and slots past S are dropped): k_new, v_new
        [L, B, W, K, D] as :meth:`write` takes them. The same result as :meth:`write` at
        positions ``arange(W)`` in every row, as one block per row: XLA:CPU scatters
        :meth:`write`'s keys of a transposed cache a float at a time (a tenth of a 16 x 500
        prefill, BENCHMARKS.md)."""
        width = min(jax.tree.leaves(v_new)[0].shape[2], self.num_slots)

        def put(cache, new, transposed):  # [L, B, W, K, D] -> the cache's [L, B, K, (D, W | W, D)]
            new = jnp.moveaxis(new[:, :, :width], 2, -1 if transposed else 3)
            at = (slice(None), rows, slice(None)) + ((slice(None), slice(0, width)) if transposed
                                                     else (slice(0, width),))
            return cache.at[at].set(new.astype(cache.dtype), mode="drop")

        return self.replace(
            k=jax.tree.map(lambda c, n: put(c, n, self.transposed_keys), self.k, k_new),
            v=jax.tree.map(lambda c, n: put(c, n, False), self.v, v_new))

    def set_rows(self, new: "KVCache", rows: jax.Array) -> "KVCache":
        """Replaces whole rows: ``new`` (a cache of B rows) into cache rows ``rows`` int [B]
        (rows beyond the cache are dropped)."""
        return jax.tree.map(lambda full, part: full.at[:, rows].set(part.astype(full.dtype), mode="drop"),
                            self, new)


@dataclasses.dataclass(frozen=True)
class StackedLayer:
    """Layer ``index`` (traced int) of a cache's stacks ``k`` and ``v`` (one group's, [L, ...]
    as in :class:`KVCache`), inside a scan over the layers: the stacks stay whole, so that a
    kernel can read the layer where it lies (``fused_attention.attend_cache``; a slice of it
    would be a copy on XLA:CPU)."""

    k: jax.Array
    v: jax.Array
    index: jax.Array


def slots_view(cache_layer: jax.Array, num_slots: int, *, transposed_keys: bool) -> jax.Array:
    """The first ``num_slots`` slots of one layer: keys [B, K, D, S] (``transposed_keys``) or
    values (or keys like them) [B, K, S, D] -> the same with S = num_slots."""
    return cache_layer[..., :num_slots] if transposed_keys else cache_layer[:, :, :num_slots]
