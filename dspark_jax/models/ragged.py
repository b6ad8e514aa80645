"""The target decoder over a flat list of tokens from many cache rows (continuous batching).

A serving step verifies a different number of tokens for each request. Instead of padding every
request to the longest one, the tokens of all requests are laid out one after another in a flat
vector of T tokens, each with its cache row (the request's slot) and its position: the paper's
"marker tensor". Embeddings, projections, MLPs and the LM head then cost O(T), the sum of the
verified tokens.

Attention is the only part that needs the rows: each layer scatters the flat queries, keys and
values into an [S, Q] grid (row, column within the row), attends per row over the row's
committed cache slots plus its own new tokens (causal by column), and gathers the result back
to the flat layout. Every row's cache is read once, as in a dense batch. A cache of no slots is
a prefill: the rows are prompts (segment ids = rows), attended by the backend's fused kernel
(``fused_attention``; on an x86 CPU with AVX-512 ``cpu_attention``'s, elsewhere on a CPU the
einsum, long rows in query chunks).

Shapes: T flat tokens, S cache rows, Q columns per row, N cache slots per row, L layers,
H query heads, K kv heads, D head dim, d hidden size, m taps.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from dspark_jax.model_config import FULL, SLIDING
from dspark_jax.models.decoder import Decoder, cache_fields, run_layers, window_mask
from dspark_jax.models.kv_cache import KVCache
from dspark_jax.models.fused_attention import (attend_cache, attend_segments,
                                               default_prefill_implementation)
from dspark_jax.models.layers import attend


class RaggedOutput(NamedTuple):
    hidden: jax.Array  # [T, d] after the final norm
    taps: jax.Array | None  # [T, m*d] raw outputs of the tapped layers, in tap order
    new_k: jax.Array | tuple  # [L, S, Q, K, D] keys of the new tokens in the row grid (zeros
    new_v: jax.Array | tuple  # elsewhere), and values; per layer group as the cache's fields


def to_grid(x: jax.Array, rows: jax.Array, cols: jax.Array, num_rows: int, width: int):
    """[T, ...] -> [S, Q, ...]; tokens with rows >= S (padding) are dropped."""
    grid = jnp.zeros((num_rows, width) + x.shape[1:], x.dtype)
    return grid.at[rows, cols].set(x, mode="drop")


def ragged_forward(model: Decoder, tokens: jax.Array, positions: jax.Array, rows: jax.Array,
                   cols: jax.Array, starts: jax.Array, cache: KVCache, *, width: int,
                   tap_layer_ids: tuple[int, ...] = (), dense: bool = False,
                   view: int | None = None, attention: str | None = None,
                   cache_attention: str | None = None) -> RaggedOutput:
    """Runs the decoder on flat tokens that extend the rows of ``cache``.

    Args:
      model: the target decoder.
      tokens, positions: int [T]; the tokens of one row must have consecutive positions
        starts[row] + col.
      rows: int [T] cache row of each token (>= S marks padding: it sees and writes nothing).
      cols: int [T] column of each token within its row, in 0..width-1.
      starts: int [S] committed length of each row: a new token sees cache slots < starts[row].
      cache: keys [L, S, K, D, N] (``transposed_keys``; else [L, S, K, N, D]), values
        [L, S, K, N, D], only read (the new entries come back in the grid layout).
      width: Q, the static number of columns of the grid.
      tap_layer_ids: static ids of layers whose raw outputs to return (-1: embeddings).
      dense: the tokens are the whole [S, Q] grid, row-major (T = S * width; ``rows`` and
        ``cols`` are then ignored): the grid is a reshape, with no scatter or gather.
      view: static number of leading cache slots the attention reads (None: all N). Every
        start must be at most ``view``: a token never sees a slot at or past its row's start,
        so the slots past the view are never read, and the attention costs O(view), not O(N).
      attention: a prefill's kernel (``fused_attention.IMPLEMENTATIONS``; None:
        ``default_prefill_implementation``); splash needs a width that is a multiple of 128
        (else the einsum).
      cache_attention: the kernel over the cache (``fused_attention.attend_cache``; None: the
        backend's).

    Returns:
      RaggedOutput(hidden [T, d], taps [T, m*d] or None, new_k / new_v [L, S, Q, K, D]).
    """
    num_rows = cache.num_rows
    num_slots = cache.num_slots if view is None else min(view, cache.num_slots)
    num_layers = model.config.num_hidden_layers
    for layer_id in tap_layer_ids:
        if not -1 <= layer_id < num_layers:
            raise ValueError(f"tap layer id {layer_id} out of range for {num_layers} layers")
    impl = attention or default_prefill_implementation()
    fused = num_slots == 0 and impl != "einsum" and (impl != "splash" or width % 128 == 0)
    h = model.embed(tokens[None])  # [1, T, d]
    cached = jnp.broadcast_to(jnp.arange(num_slots)[None, None, :] < starts[:, None, None],
                              (num_rows, width, num_slots))
    causal = jnp.broadcast_to(jnp.arange(width)[None, :] <= jnp.arange(width)[:, None],
                              (num_rows, width, width))

    # Per layer type: (rope, mask over the cache, its lengths, over the row's new tokens, window).
    def inputs_of(layer_type):
        if layer_type == FULL:
            return model.rope(positions[None]), cached, starts, causal, None
        window = model.config.sliding_window  # a grid token (row, col) is at starts[row] + col
        if fused:  # the kernel takes the window itself (static)
            return model.rope(positions[None], SLIDING), None, None, None, window
        columns = jnp.arange(width)
        return (model.rope(positions[None], SLIDING),
                cached & window_mask(starts[:, None] + columns, jnp.arange(num_slots)[None], window),
                None, causal & window_mask(columns, columns, window), None)
    tap_ids = jnp.asarray(tap_layer_ids, jnp.int32)
    taps = None
    if tap_layer_ids:
        taps = jnp.where((tap_ids == -1)[:, None, None, None], h[None],
                         jnp.zeros((len(tap_layer_ids),) + h.shape, h.dtype))
    safe_rows = jnp.minimum(rows, num_rows - 1)

    def grid(x):  # [T, ...] -> [S, Q, ...]
        if dense:
            return x.reshape((num_rows, width) + x.shape[1:])
        return to_grid(x, rows, cols, num_rows, width)

    def step(layer, index, inputs, cache_l, carry):
        h, taps = carry
        attn = layer.self_attn
        (cos_l, sin_l), cached_l, lengths_l, causal_l, window_l = inputs
        x = layer.input_layernorm(h)
        q = attn.queries(x, cos_l, sin_l)[0]
        k_new, v_new = (t[0] for t in attn.keys_values(x, cos_l, sin_l))
        k_grid, v_grid, q_grid = (grid(x) for x in (k_new, v_new, q))
        if num_slots:
            out = attend_cache(q_grid, cache_l.k, cache_l.v, cached_l, k_grid, v_grid, causal_l,
                               layer=cache_l.index, lengths=lengths_l, view=num_slots, scale=attn.scale,
                               transposed_keys=cache.transposed_keys, implementation=cache_attention)
        elif fused:  # a prefill: each row one segment of its tokens
            out = attend_segments(q_grid, k_grid, v_grid, row_tokens, scale=attn.scale,
                                  window=window_l, implementation=impl, max_segments=1)
        else:  # a prefill: no history, long rows attended in query chunks
            out = attend(q_grid, k_grid, v_grid, causal_l, scale=attn.scale)
        out = out.reshape(q.shape) if dense else out[safe_rows, cols]
        h = layer.finish(h, out[None])
        if taps is not None:
            taps = jnp.where((tap_ids == index)[:, None, None, None], h[None], taps)
        return (h, taps), (k_grid, v_grid)

    row_tokens = grid(jnp.ones(tokens.shape, jnp.int32)) if fused else None  # [S, Q]: 1 = token
    (h, taps), outs = run_layers(model, step, (h, taps), inputs_of, (cache.k, cache.v),
                                 split_types=fused)
    if taps is not None:
        taps = jnp.moveaxis(taps[:, 0], 0, 1).reshape(tokens.shape[0], -1)
    new_k, new_v = cache_fields(outs)
    return RaggedOutput(model.norm(h)[0], taps, new_k, new_v)
