"""The target decoder family: Llama, Qwen2 (q/k/v bias), Qwen3 (per-head q/k RMSNorm),
Gemma3 (scaled embeddings, 1 + weight norms around attention and MLP, tanh-GELU MLP, sliding
window layers with their own rope, logit soft-capping) and Gemma4 (Gemma3's layout with plain
norms, a value norm, a scalar per layer, and full-attention layers of their own shape).

One Flax NNX module whose decoder layers are stacked along a leading ``layers`` axis and run
with ``jax.lax.scan``, so compile time does not grow with depth. When the full-attention
layers have a shape of their own (Gemma4), they are stacked apart in ``global_layers``, and
each run of consecutive layers of one stack is a scan (:func:`run_layers`). The forward pass returns the
final-normed hidden states, the raw outputs of any tapped layers (the DFlash context features,
DSPARK_SPEC.md section 3) and the updated KV cache; logits are a separate call so that
training can run the LM head only where it needs it.

Sliding-window layers keep every slot of the KV cache like full layers and mask the keys
more than ``sliding_window - 1`` positions back (exact; the memory of a ring buffer per sliding
layer is not saved).

Callers use it pure-functionally: ``graphdef, state = nnx.split(model)`` outside, and
``nnx.merge(graphdef, state)`` inside a jitted function.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dspark_jax.model_config import FULL, SLIDING, attention_dims, layer_groups
from dspark_jax.models import cpu_matmul, layer_weights
from dspark_jax.models.fused_attention import attend_cache, attend_segments
from dspark_jax.models.kv_cache import KVCache, StackedLayer
from dspark_jax.models.layers import (MLP, Attention, Embedding, RMSNorm, _param, attend,
                                      rope_cos_sin, rope_frequencies, with_min_rows)


class DecoderOutput(NamedTuple):
    hidden: jax.Array  # [B, T, d] after the final norm
    taps: jax.Array | None  # [B, T, m*d] raw outputs of the tapped layers, in tap order
    cache: KVCache | None  # the cache with the new entries written (write_cache=True)
    new_kv: tuple | None = None  # (k, v) [L, B, T, K, D] of the new tokens (write_cache=False)


class DecoderLayer(nnx.Module):
    """Pre-norm layer: h += attn(input_layernorm(h)); h += mlp(post_attention_layernorm(h)).

    With ``sandwich_norms`` (Gemma) the outputs are normed too:
    h += post_attention_layernorm(attn(input_layernorm(h)));
    h += post_feedforward_layernorm(mlp(pre_feedforward_layernorm(h))).

    The attention core is the caller's (over a cache, a grid of rows or draft blocks):
    ``input_layernorm`` gives its input, :meth:`finish` the layer output from its result.
    """

    def __init__(self, cfg, *, dtype, rngs: nnx.Rngs, layer_type: str = FULL):
        def norm():
            return RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype, offset=cfg.norm_offset)

        self.input_layernorm = norm()
        self.self_attn = Attention(cfg, dtype=dtype, rngs=rngs, layer_type=layer_type)
        self.post_attention_layernorm = norm()
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size, dtype=dtype, rngs=rngs,
                       bias=cfg.mlp_bias, activation=cfg.hidden_act)
        self.sandwich_norms = cfg.sandwich_norms
        if self.sandwich_norms:
            self.pre_feedforward_layernorm = norm()
            self.post_feedforward_layernorm = norm()
        # Gemma4: the layer's output times a stored scalar (a buffer in transformers, frozen here).
        self.layer_scalar = (_param(None, (1,), dtype, (None,), init="ones")
                             if cfg.layer_scalar else None)

    def finish(self, h: jax.Array, attended: jax.Array) -> jax.Array:
        """The layer output: h [B, T, d] and the attention result [B, T, H, D] -> [B, T, d]."""
        out = self.self_attn.output(attended)
        if not self.sandwich_norms:
            h = h + out
            return h + self.mlp(self.post_attention_layernorm(h))
        h = h + self.post_attention_layernorm(out)
        h = h + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(h)))
        return h if self.layer_scalar is None else h * self.layer_scalar[...]


def pick(sliding: jax.Array, full, slid):
    """A layer's input in a scan over layers of both types: ``full`` for a full-attention
    layer, ``slid`` (a pytree of the same structure) for a sliding one; ``sliding`` is the
    scanned bool []. An input that one type leaves None (a full layer's cache lengths, which
    a window does not bound) is None for both."""
    return jax.tree.map(lambda a, b: None if a is None or b is None else jnp.where(sliding, b, a),
                        full, slid, is_leaf=lambda x: x is None)


def window_mask(q_positions: jax.Array, k_positions: jax.Array, window: int) -> jax.Array:
    """bool [..., T, S]: key s is among the last ``window`` positions up to query t
    (k_pos > q_pos - window; transformers' sliding_window_overlay), from q int [..., T] and
    k int [..., S]."""
    return k_positions[..., None, :] > q_positions[..., :, None] - window


def causal_mask(q_positions: jax.Array, k_positions: jax.Array,
                k_valid: jax.Array | None = None) -> jax.Array:
    """bool [B, T, S]: query t sees key s when k_pos[s] <= q_pos[t] (and key s is valid)."""
    mask = k_positions[:, None, :] <= q_positions[:, :, None]
    if k_valid is not None:
        mask &= k_valid[:, None, :]
    return mask


def layer_runs(cfg, split_types: bool = False) -> tuple[tuple[int, int, int], ...]:
    """(group, first, end) of each maximal run of consecutive layers in one group
    (``model_config.layer_groups``) and, with ``split_types``, of one layer type, in layer
    order; first / end index the group's stack."""
    groups = layer_groups(cfg)
    group_of = {i: (g, j) for g, ids in enumerate(groups) for j, i in enumerate(ids)}
    runs = []
    for layer in range(cfg.num_hidden_layers):
        g, j = group_of[layer]
        same_type = not split_types or cfg.layer_types[layer] == cfg.layer_types[layer - 1]
        if runs and runs[-1][0] == g and same_type:
            runs[-1][2] = j + 1
        else:
            runs.append([g, j, j + 1])
    return tuple(tuple(r) for r in runs)


def run_layers(model: "Decoder", body, carry, inputs_of, caches, split_types: bool = False):
    """Runs the decoder layers in order, each run of consecutive layers of one group
    (:func:`layer_runs`) as a ``lax.scan`` over its slice of the group's stack.

    Args:
      model: the decoder.
      body: ``body(layer, index, inputs, cache, carry) -> (carry, out)``, one layer: its merged
        module, its layer id (traced int), its inputs, its ``kv_cache.StackedLayer`` (or None).
      carry: the scan carry (e.g. hidden states and taps).
      inputs_of: ``inputs_of(layer_type)`` -> the per-layer-type inputs (rope, masks), a pytree
        of the same structure for both types while a group mixes them (Gemma3).
      caches: None, or the cache's (k, v), per group (``KVCache.k`` / ``.v``).
      split_types: one scan per run of one layer type too, so that every layer's inputs may be
        static (a fused kernel's window).

    Returns:
      (carry, outs): ``outs`` a tuple with, per group, the stacked outputs [L_g, ...] of its
      layers.

    A run of part of a stack reads its layers from the whole stack (and cache) inside the scan,
    by index, as a scan over a whole stack does: slicing the stack first would copy it. The
    body gets the cache's stacks whole with its layer's index, so that a kernel can read the
    layer where it lies (``fused_attention.attend_cache``).
    """
    cfg = model.config
    groups = layer_groups(cfg)
    if caches is None:
        caches = ((None,) * len(groups),) * 2
    k_groups, v_groups = (c if isinstance(c, tuple) else (c,) for c in caches)
    outs = [[] for _ in groups]
    for g, first, end in layer_runs(cfg, split_types):
        ids = groups[g][first:end]
        graphdef, state = nnx.split(model.layer_stacks[g])
        stack = jax.tree.map(lambda x: layer_weights.run_of(x, first, end),
                             (state, k_groups[g], v_groups[g]), is_leaf=layer_weights.is_unstacked)
        types = {cfg.layer_types[i] for i in ids}
        sliding = None
        if len(types) == 1:
            inputs = inputs_of(types.pop())
        else:  # the scan picks each layer's inputs (traced once, right here)
            inputs = (inputs_of(FULL), inputs_of(SLIDING))
            sliding = jnp.asarray([cfg.layer_types[i] == SLIDING for i in ids])

        def step(carry, xs):
            entry, index, is_sliding = xs
            weights, k_stack, v_stack = stack
            state = jax.tree.map(lambda x: layer_weights.layer(x, entry, first), weights,
                                 is_leaf=layer_weights.is_unstacked)
            cache = None if k_stack is None else StackedLayer(k_stack, v_stack, entry)
            layer_inputs = inputs if sliding is None else pick(is_sliding, *inputs)
            return body(nnx.merge(graphdef, state), index, layer_inputs, cache, carry)

        carry, out = jax.lax.scan(step, carry, (jnp.arange(first, end), jnp.asarray(ids), sliding))
        outs[g].append(out)
    return carry, tuple(o[0] if len(o) == 1 else jax.tree.map(lambda *xs: jnp.concatenate(xs), *o)
                        for o in outs)


def cache_fields(outs: tuple) -> tuple:
    """Per-group (k, v) outputs of :func:`run_layers` -> (k, v) in the cache fields' form: the
    arrays themselves for one group, tuples for several."""
    def field(i):
        parts = tuple(o[i] for o in outs)
        return parts[0] if len(parts) == 1 else parts

    return field(0), field(1)


def stacked(make_layer, num_layers: int, rngs: nnx.Rngs):
    """Builds ``num_layers`` layers with parameters stacked along a leading 'layers' axis."""

    @nnx.split_rngs(splits=num_layers)
    @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
    def build(r):
        return make_layer(r)

    return build(rngs)


class Decoder(nnx.Module):
    """Llama / Qwen2 / Qwen3 / Gemma3 / Gemma4 causal decoder.

    ``layers`` stacks every layer, or (Gemma4, ``model_config.layer_groups``) the sliding ones,
    and ``global_layers`` the full-attention ones (None otherwise)."""

    def __init__(self, cfg, *, dtype=jnp.float32, rngs: nnx.Rngs):
        self.config = cfg
        self.dtype = dtype
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size, dtype=dtype, rngs=rngs)
        stacks = [stacked(lambda r, t=cfg.layer_types[ids[0]]: DecoderLayer(cfg, dtype=dtype, rngs=r,
                                                                              layer_type=t),
                          len(ids), rngs) for ids in layer_groups(cfg)]
        self.layers = stacks[0]
        self.global_layers = stacks[1] if len(stacks) > 1 else None
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype, offset=cfg.norm_offset)
        self.lm_head = (None if cfg.tie_word_embeddings else
                        _param(rngs, (cfg.hidden_size, cfg.vocab_size), dtype, ("embed", "vocab")))

    # -- pieces shared with the drafter ---------------------------------------------------

    def embed(self, tokens: jax.Array) -> jax.Array:
        """int [B, T] -> [B, T, d] in the activation dtype :attr:`dtype` (times sqrt(d) in the
        table's dtype for Gemma; a bfloat16 table under float32 activations,
        ``layer_weights.with_dtype``, gives its rows in float32)."""
        return self.scale_embedding(self.embed_tokens(tokens)).astype(self.dtype)

    def scale_embedding(self, rows: jax.Array) -> jax.Array:
        """Embedding rows [..., d] as the decoder's input: times sqrt(d) (in their dtype) for
        Gemma, unchanged otherwise."""
        if self.config.embed_scale:
            return rows * jnp.asarray(self.config.hidden_size ** 0.5, rows.dtype)
        return rows

    def lm_head_matrix(self) -> jax.Array:
        """The LM head [d, V] (the transposed embedding when tied)."""
        return self.embed_tokens.embedding[...].T if self.lm_head is None else self.lm_head[...]

    def lm_head_stored(self) -> tuple[jax.Array, str]:
        """The LM head as it is held, with its einsum axes: the embedding [V, d] ("vd") when
        tied, else [d, V] ("dv"). XLA:CPU multiplies a bfloat16 matrix in place only as it is
        held: a transposed bfloat16 table is first converted to a float32 copy (BENCHMARKS.md)."""
        if self.lm_head is None:
            return self.embed_tokens.embedding[...], "vd"
        return self.lm_head[...], "dv"

    def lm_head_rows(self, vocab_ids: jax.Array) -> jax.Array:
        """The LM head's rows of the tokens ``vocab_ids`` int [V'] -> [V', d] (embedding rows
        when tied), for :meth:`logits` over those tokens only."""
        if self.lm_head is None:
            return jnp.take(self.embed_tokens.embedding[...], vocab_ids, axis=0)
        return jnp.take(self.lm_head[...], vocab_ids, axis=1).T

    def logits(self, hidden: jax.Array, head_rows: jax.Array | None = None) -> jax.Array:
        """Final-normed hidden [..., d] -> float32 logits [..., V] (``hidden @ lm_head_matrix()``,
        soft-capped by ``final_logit_softcapping`` when the config sets it); with ``head_rows``
        (:meth:`lm_head_rows` of V' tokens), only those tokens' logits [..., V']. A head held in
        another dtype than ``hidden`` (bfloat16 weights, ``layer_weights.with_dtype``)
        multiplies ``hidden`` rounded to its dtype, on at least ``layers.MIN_ROWS`` rows, and is
        read as it is held (:meth:`lm_head_stored`). A few float32 rows on CPU multiply the
        head as it is held through ``cpu_matmul`` (float32, or bfloat16 on AMX)."""
        head, axes = (head_rows, "vd") if head_rows is not None else self.lm_head_stored()
        rows = hidden.astype(head.dtype)
        if cpu_matmul.applies(rows, head, jnp.float32, transpose_w=axes == "vd"):
            logits = cpu_matmul.matmul(rows, head, transpose_w=axes == "vd")  # read it once
        else:
            if head_rows is None and head.dtype == jnp.float32:
                head, axes = self.lm_head_matrix(), "dv"  # XLA's float32 dot: the transpose
            subscripts = f"...d,{axes}->...v"

            def product(h):
                return jnp.einsum(subscripts, h, head, preferred_element_type=jnp.float32)

            logits = product(hidden) if head.dtype == hidden.dtype else with_min_rows(product, rows)
        cap = self.config.final_logit_softcapping
        return logits if cap is None else cap * jnp.tanh(logits / cap)

    @property
    def layer_stacks(self) -> tuple:
        """The stacked layers of each layer group (``model_config.layer_groups``)."""
        return (self.layers,) if self.global_layers is None else (self.layers, self.global_layers)

    def rope(self, positions: jax.Array, layer_type: str = FULL):
        """int [B, T] -> (cos, sin) [B, T, D] of the full-attention layers (or of ``layer_type``)."""
        cfg = self.config
        theta, scaling = ((cfg.local_rope_theta, cfg.local_rope_scaling) if layer_type == SLIDING
                          else (cfg.rope_theta, cfg.rope_scaling))
        head_dim = attention_dims(cfg, layer_type)[1]
        inv_freq, scale = rope_frequencies(head_dim, theta, scaling, cfg.max_position_embeddings)
        return rope_cos_sin(positions, inv_freq, scale)

    # -- forward ----------------------------------------------------------------------------

    def __call__(self, tokens: jax.Array, positions: jax.Array, *, cache: KVCache | None = None,
                 key_valid: jax.Array | None = None, mask: jax.Array | None = None,
                 segment_ids: jax.Array | None = None, max_segments: int | None = None,
                 attention: str | None = None,
                 cache_attention: str | None = None, tap_layer_ids: tuple[int, ...] = (),
                 write_cache: bool = True) -> DecoderOutput:
        """Runs the decoder on ``tokens`` at ``positions``.

        Args:
          tokens: int [B, T].
          positions: int [B, T]; with a cache they must be consecutive per row, starting at
            the row's committed length, and are also the slots written.
          cache: optional KV cache; when given, queries attend over the committed slots
            (s < positions[:, 0]) and causally over the new tokens, and the new keys/values are
            written at ``positions`` afterwards (one scatter, so the cache is never copied).
          key_valid: bool [B, T], only without a cache: keys that may be attended to.
          mask: bool [B, T, T] overriding the default causal mask without a cache.
          segment_ids: int [B, T], instead of ``mask`` without a cache: packed rows, each token
            attending causally within its segment (0: padding), through the fused kernel
            ``attention`` (``fused_attention.IMPLEMENTATIONS``; None: the backend's).
          max_segments: static, with ``segment_ids``: a bound on a row's segments, laid out as
            the pipeline packs them (``fused_attention.attend_segments``; None: no bound).
          cache_attention: with a cache, the kernel over it (``fused_attention.attend_cache``;
            None: the backend's).
          tap_layer_ids: static ids of layers whose raw outputs to return (-1: embeddings).
          write_cache: with a cache, False returns the new entries in ``new_kv`` instead of
            writing them (the caller writes them later, e.g. outside a ``lax.switch``).

        Returns:
          DecoderOutput(hidden [B, T, d], taps [B, T, m*d] or None, cache).
        """
        num_layers = self.config.num_hidden_layers
        for layer_id in tap_layer_ids:
            if not -1 <= layer_id < num_layers:
                raise ValueError(f"tap layer id {layer_id} out of range for {num_layers} layers")
        h = self.embed(tokens)
        if segment_ids is not None and (cache is not None or mask is not None or key_valid is not None):
            raise ValueError("segment_ids replace the mask of a forward without a cache")
        if mask is None and segment_ids is None:
            mask = causal_mask(positions, positions, key_valid)
        committed = lengths = None
        if cache is not None:
            lengths = positions[:, 0]  # a full layer's queries see exactly the slots < lengths
            committed = jnp.arange(cache.num_slots)[None, None, :] < lengths[:, None, None]
            committed = jnp.broadcast_to(committed, (tokens.shape[0], tokens.shape[1], cache.num_slots))

        # Per layer type: (rope, mask over the new tokens, over the cache, its lengths, window).
        def inputs_of(layer_type):
            if layer_type == FULL:
                return self.rope(positions), mask, committed, lengths, None
            window = self.config.sliding_window
            if segment_ids is not None:  # a static window for the fused kernel
                return self.rope(positions, SLIDING), None, None, None, window
            return (self.rope(positions, SLIDING), mask & window_mask(positions, positions, window),
                    None if cache is None else
                    committed & window_mask(positions, jnp.arange(cache.num_slots)[None], window),
                    None, None)

        requested = tuple(tap_layer_ids)
        tap_layer_ids = tuple(dict.fromkeys(requested))  # a layer fills one slot: dedupe
        tap_slot = np.full((num_layers,), -1, np.int32)
        for slot, layer_id in enumerate(tap_layer_ids):
            if layer_id >= 0:
                tap_slot[layer_id] = slot
        taps = jnp.zeros((len(tap_layer_ids),) + h.shape, h.dtype) if tap_layer_ids else None
        if -1 in tap_layer_ids:
            taps = taps.at[tap_layer_ids.index(-1)].set(h)

        tap_slot = jnp.asarray(tap_slot)

        def step(layer, index, inputs, cache_l, carry):
            h, taps = carry
            attn = layer.self_attn
            (cos_l, sin_l), mask_l, committed_l, lengths_l, window_l = inputs
            x = layer.input_layernorm(h)
            q = attn.queries(x, cos_l, sin_l)
            k_new, v_new = attn.keys_values(x, cos_l, sin_l)
            if segment_ids is not None:
                attended = attend_segments(q, k_new, v_new, segment_ids, scale=attn.scale,
                                           window=window_l, implementation=attention,
                                           max_segments=max_segments)
            elif cache_l is None:
                attended = attend(q, k_new, v_new, mask_l, scale=attn.scale)
            else:
                attended = attend_cache(q, cache_l.k, cache_l.v, committed_l, k_new, v_new, mask_l,
                                        layer=cache_l.index, lengths=lengths_l, scale=attn.scale,
                                        transposed_keys=cache.transposed_keys,
                                        implementation=cache_attention)
            h = layer.finish(h, attended)
            if taps is not None:
                slot = tap_slot[index]
                taps = jax.lax.cond(slot >= 0, lambda t: t.at[slot].set(h), lambda t: t, taps)
            return (h, taps), (k_new, v_new) if cache_l is not None else None

        (h, taps), outs = run_layers(self, step, (h, taps), inputs_of,
                                     None if cache is None else (cache.k, cache.v),
                                     split_types=segment_ids is not None)
        new_kv = None if cache is None else cache_fields(outs)
        if cache is not None and write_cache:
            cache, new_kv = cache.write(*new_kv, positions), None
        if taps is not None:
            if tap_layer_ids != requested:
                taps = taps[np.asarray([tap_layer_ids.index(i) for i in requested])]
            taps = jnp.moveaxis(taps, 0, 2).reshape(*h.shape[:2], -1)
        return DecoderOutput(self.norm(h), taps, cache if write_cache else None, new_kv)
