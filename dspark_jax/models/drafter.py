"""The DSpark parallel drafting backbone (paper Eqs. 2-3, DSPARK_SPEC.md sections 3, 4, 7).

``DSparkModel`` holds only the drafter's own parameters: the context projection (``fc``,
``hidden_norm``), the stacked draft decoder layers (the target family's
:class:`~dspark_jax.models.decoder.DecoderLayer`, so Qwen3 drafters get q/k norms), the final
``norm``, an optional trained mask vector, the sequential head and the confidence head. The
embedding and LM head stay the target's: every method that needs them takes the target
:class:`~dspark_jax.models.decoder.Decoder` as an argument, so they are never copied and never
trained.

A draft layer attends from the block to the concatenation of keys/values projected from the
context features (no input norm on them) and from the block itself; inside a block attention is
bidirectional. Two entry points share one layer loop:

* :meth:`DSparkModel.draft` (inference): new context features are projected, their K/V
  (k_norm'd, RoPE'd) written into a draft KV cache at slot == position, and the block
  [anchor, MASK x (B - 1)] attends to cached slots < anchor position plus itself.
* :meth:`DSparkModel.forward_train` (training, teacher forcing): N anchors per sequence at
  once; block j sees context keys strictly before its anchor (same segment when packing) and
  only its own block.

Shapes: b rows, S context length (or cache slots), C new context tokens, N anchors per row,
B block size, P proposal slots, m taps, d hidden size, V vocabulary, K kv heads, D head dim.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from dspark_jax.model_config import attention_dims
from dspark_jax.models import layer_weights
from dspark_jax.models.decoder import Decoder, DecoderLayer, stacked
from dspark_jax.models.fused_attention import attend_cache, attend_draft_blocks
from dspark_jax.models.heads import ConfidenceHead, block_bias, make_head
from dspark_jax.models.kv_cache import KVCache
from dspark_jax.models.layers import Linear, RMSNorm, _param, rope_cos_sin, rope_frequencies


def first_proposal_slot(cfg) -> int:
    """The first block slot that proposes a token: 0 when the anchor slot predicts (DeepSpec),
    1 when only the mask slots do (z-lab DFlash). P = block_size - this."""
    return 0 if cfg.anchor_predicts else 1


class DraftOutput(NamedTuple):
    hidden: jax.Array  # [b, B, d] final-normed hidden states of the block
    cache: KVCache  # draft context cache with the new context K/V written


class TrainOutput(NamedTuple):
    hidden: jax.Array  # [b, N, B, d] final-normed draft hidden states
    prev: jax.Array  # int32 [b, N, B] teacher-forced previous token of each slot
    labels: jax.Array  # int32 [b, N, B] token each slot predicts
    eval_mask: jax.Array  # bool [b, N, B] contiguous valid prefix of each kept block
    logits: jax.Array | None  # float32 [b, N, B, V] base + sequential-head bias
    confidence: jax.Array | None  # float32 [b, N, B] confidence logits


class BlockMask(NamedTuple):
    """What a block token may attend to in training (spec 4.4), without the dense T x T part.

    Query (block j, slot k) sees context key s where ``context[b, j*B + k, s]`` and every key of
    block j when ``keep[b, j*B + k]``; the block-to-block part is block diagonal, so it is
    implied rather than stored (``layers.attend_blockwise``)."""

    context: jax.Array  # bool [b, N*B, S]
    keep: jax.Array  # bool [b, N*B]

    def dense(self, block_size: int) -> jax.Array:
        """The equivalent dense mask bool [b, N*B, S + N*B] (for checks and small cases)."""
        q_block = jnp.arange(self.keep.shape[1]) // block_size
        same = jnp.broadcast_to(q_block[:, None] == q_block[None, :],
                                (self.keep.shape[0],) + (q_block.shape[0],) * 2)
        return jnp.concatenate([self.context, same & self.keep[:, :, None]], axis=-1)


def block_attention_mask(*, anchors: jax.Array, keep: jax.Array, context_len: int, block_size: int,
                         segment_ids: jax.Array | None = None) -> BlockMask:
    """The training attention mask (spec 4.4).

    Args:
      anchors: int [b, N] anchor index of each block in the context.
      keep: bool [b, N]; dummy blocks (False) see nothing (their rows give zeros).
      context_len: S.
      block_size: B.
      segment_ids: optional int [b, S] for packed rows: a block also needs the context key to
        be in its anchor's segment.

    Returns:
      BlockMask: query (block j, slot k) sees context key s when s < anchor_j (and same
      segment), and every key of block j.
    """
    num_blocks = anchors.shape[1]
    q_block = jnp.arange(num_blocks * block_size) // block_size  # [N*B]
    q_anchor = anchors[:, q_block]  # [b, N*B]
    context = jnp.arange(context_len)[None, None, :] < q_anchor[:, :, None]
    if segment_ids is not None:
        anchor_segment = jnp.take_along_axis(segment_ids, anchors, axis=1)[:, q_block]
        context &= segment_ids[:, None, :] == anchor_segment[:, :, None]
    q_keep = keep[:, q_block]
    return BlockMask(context & q_keep[:, :, None], q_keep)


def sample_anchors(key: jax.Array, loss_mask: jax.Array, num_anchors: int,
                   segment_ids: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """Up to N anchors per row, uniformly without replacement, sorted (spec 4.1).

    Position i is a candidate when loss_mask[i] and loss_mask[i + 1] (and both are in the same
    segment). Returns (anchors int32 [b, N], keep bool [b, N]); unused slots are anchor 0 with
    keep False.
    """
    mask = loss_mask.astype(bool)
    candidate = mask[:, :-1] & mask[:, 1:]
    if segment_ids is not None:
        candidate &= segment_ids[:, :-1] == segment_ids[:, 1:]
    rank = jnp.where(candidate, jax.random.uniform(key, candidate.shape), 2.0)
    order = jnp.argsort(rank, axis=1).astype(jnp.int32)
    pad = max(num_anchors - order.shape[1], 0)
    order = jnp.pad(order, ((0, 0), (0, pad)))[:, :num_anchors]
    count = jnp.minimum(candidate.sum(axis=1), num_anchors)
    keep = jnp.arange(num_anchors)[None, :] < count[:, None]
    big = jnp.iinfo(jnp.int32).max
    anchors = jnp.sort(jnp.where(keep, order, big), axis=1)
    return jnp.where(keep, anchors, 0), keep


class DSparkModel(nnx.Module):
    """The drafter's network (DeepSpec's ``DSparkModel``; without heads, the DFlash baseline):
    its parameters and forward passes. ``dspark_jax.drafter.Drafter`` binds it to a target.

    Args:
      model_cfg: the draft layers' architecture, a target-style config (``model_config.py``)
        whose ``num_hidden_layers`` is the number of draft layers; kept as ``.model_config``.
      cfg: the drafter config (``drafter_config.py``); kept as ``.config``.
    """

    def __init__(self, model_cfg, cfg, *, dtype=jnp.float32, rngs: nnx.Rngs):
        self.model_config = model_cfg
        self.config = cfg
        d = model_cfg.hidden_size
        self.fc = Linear(len(cfg.target_layer_ids) * d, d, names=("taps", "embed"), dtype=dtype,
                         rngs=rngs)
        self.hidden_norm = RMSNorm(d, model_cfg.rms_norm_eps, dtype=dtype,
                                   offset=model_cfg.norm_offset)
        self.layers = stacked(lambda r: DecoderLayer(model_cfg, dtype=dtype, rngs=r),
                              cfg.num_layers, rngs)
        self.norm = RMSNorm(d, model_cfg.rms_norm_eps, dtype=dtype, offset=model_cfg.norm_offset)
        self.mask_embedding = (_param(rngs, (d,), dtype, ("embed",))
                               if cfg.trainable_mask_embedding else None)
        self.markov_head = make_head(cfg.head, vocab=model_cfg.vocab_size, rank=cfg.markov_rank,
                                     hidden_size=d, dtype=dtype, rngs=rngs)
        self.confidence_head = (
            ConfidenceHead(hidden_size=d, rank=cfg.markov_rank if cfg.confidence_head_with_markov else 0,
                           dtype=dtype, rngs=rngs)
            if cfg.confidence_head else None)

    # -- pieces --------------------------------------------------------------------------------

    @property
    def first_proposal_slot(self) -> int:
        """0 when the anchor slot predicts (DeepSpec), 1 when only mask slots do (z-lab DFlash)."""
        return first_proposal_slot(self.config)

    def context(self, taps: jax.Array) -> jax.Array:
        """Context features (Eq. 2): taps [..., m*d] -> hidden_norm(fc(taps)) [..., d]."""
        return self.hidden_norm(self.fc(taps))

    def rope(self, positions: jax.Array):
        """int [b, T] -> (cos, sin) [b, T, D] with the draft config's rope."""
        cfg = self.model_config
        inv_freq, scale = rope_frequencies(attention_dims(cfg)[1], cfg.rope_theta, cfg.rope_scaling,
                                           cfg.max_position_embeddings)
        return rope_cos_sin(positions, inv_freq, scale)

    def mask_vector(self, target: Decoder) -> jax.Array:
        """The mask-slot embedding [d]: the trained vector or the target's row mask_token_id,
        scaled as the target scales its embeddings (Gemma: times sqrt(d), as DeepSpec embeds
        the mask token with the target's scaled embedding)."""
        if self.mask_embedding is not None:
            return target.scale_embedding(self.mask_embedding[...])
        return target.embed(jnp.asarray(self.config.mask_token_id))

    def block_embeddings(self, target: Decoder, anchor_tokens: jax.Array,
                         keep: jax.Array | None = None) -> jax.Array:
        """[anchor, MASK x (B - 1)] embeddings: int [...] -> [..., B, d] (all MASK where not keep)."""
        anchor = target.embed(anchor_tokens)
        mask = jnp.broadcast_to(self.mask_vector(target).astype(anchor.dtype), anchor.shape)
        if keep is not None:
            anchor = jnp.where(keep[..., None], anchor, mask)
        rest = jnp.broadcast_to(mask[..., None, :], anchor.shape[:-1] + (self.config.block_size - 1,
                                                                         anchor.shape[-1]))
        return jnp.concatenate([anchor[..., None, :], rest], axis=-2)

    def init_cache(self, batch: int, slots: int, dtype=None,
                   transposed_keys: bool | None = None) -> KVCache:
        """An empty draft context cache (``KVCache.zeros``: keys [num_layers, batch, K, D, slots]
        or, off a CPU, [num_layers, batch, K, slots, D]; values [num_layers, batch, K, slots, D])."""
        cfg = self.model_config
        dtype = dtype or self.fc.kernel[...].dtype
        return KVCache.zeros(self.config.num_layers, batch, slots, *attention_dims(cfg)[:2], dtype,
                             transposed_keys)

    def _layer_scan(self, body, carry):
        """Runs ``body(layer, index, carry) -> (carry, out)`` over the draft layers as one
        ``lax.scan``: the stacked parameters sliced by the scan, or matrices held per layer
        (``Drafter.inference_state``) each read in place by its index. Returns (carry, the
        stacked outs)."""
        graphdef, state = nnx.split(self.layers)
        indices = jnp.arange(self.config.num_layers)
        if any(map(layer_weights.is_unstacked,
                   jax.tree.leaves(state, is_leaf=layer_weights.is_unstacked))):
            def by_index(carry, index):
                layer = jax.tree.map(lambda x: layer_weights.layer(x, index), state,
                                     is_leaf=layer_weights.is_unstacked)
                return body(nnx.merge(graphdef, layer), index, carry)

            return jax.lax.scan(by_index, carry, indices)
        return jax.lax.scan(lambda carry, xs: body(nnx.merge(graphdef, xs[0]), xs[1], carry),
                            carry, (state, indices))

    def _run_layers(self, h, *, cos, sin, ctx, ctx_cos, ctx_sin, mask: BlockMask,
                    attention: str | None = None):
        """The draft layers over blocks and their context, without a cache (training).

        Args:
          h: [b, T, d] embeddings of T = n * block_size block tokens; cos/sin [b, T, D] at the
            block positions.
          ctx: [b, C, d] projected context features; ctx_cos/ctx_sin [b, C, D].
          mask: BlockMask with context bool [b, T, C] and keep [b, T]; each block also sees its
            own tokens.
          attention: the implementation of the attention (``fused_attention.attend_draft_blocks``;
            None: the backend's).

        Returns:
          final-normed hidden [b, T, d].
        """
        def body(layer, _, h):
            attn = layer.self_attn
            k_ctx, v_ctx = attn.keys_values(ctx, ctx_cos, ctx_sin)  # [b, C, K, D]
            x = layer.input_layernorm(h)
            q = attn.queries(x, cos, sin)
            k_block, v_block = attn.keys_values(x, cos, sin)
            out = attend_draft_blocks(q, k_ctx.astype(k_block.dtype), v_ctx.astype(v_block.dtype),
                                      mask.context, k_block, v_block, mask.keep,
                                      block_size=self.config.block_size, scale=attn.scale,
                                      implementation=attention)
            return layer.finish(h, out), None

        h, _ = self._layer_scan(body, h)
        return self.norm(h)

    # -- heads ---------------------------------------------------------------------------------

    def logits(self, target: Decoder, hidden: jax.Array, prev: jax.Array) -> jax.Array:
        """Teacher-forced draft logits: lm_head(hidden) + head bias(prev).

        hidden [..., P, d], prev int [..., P] -> float32 [..., P, V]. Call it on chunks of
        anchors when [N, B, V] does not fit.
        """
        return target.logits(hidden) + block_bias(self.markov_head, prev, hidden)

    def confidence(self, hidden: jax.Array, prev: jax.Array) -> jax.Array | None:
        """Confidence logits (Eq. 7): hidden [..., d], prev int [...] -> float32 [...] or None."""
        if self.confidence_head is None:
            return None
        prev_embedding = (self.markov_head.prev_embedding(prev)
                          if self.config.confidence_head_with_markov else None)
        return self.confidence_head(hidden, prev_embedding)

    # -- inference -----------------------------------------------------------------------------

    def draft(self, target: Decoder, *, ctx_taps: jax.Array, ctx_positions: jax.Array,
              cache: KVCache, anchor_tokens: jax.Array, anchor_positions: jax.Array) -> DraftOutput:
        """One draft block per row (spec 7.2), appending new context to the draft cache.

        Args:
          target: the target decoder (embedding, for the anchor and mask rows).
          ctx_taps: [b, C, m*d] raw target taps of newly committed tokens (in tap order).
          ctx_positions: int [b, C] their positions (= cache slots); entries at positions
            >= cache.num_slots are padding and are dropped.
          cache: draft cache (kv_cache.py layout, L_draft layers); slot s holds the projected,
            k_norm'd and RoPE'd context K/V of position s.
          anchor_tokens: int [b], the last committed token of each row.
          anchor_positions: int [b], its position; context slots < it are visible.

        Returns:
          DraftOutput(hidden [b, B, d] for block positions anchor + [0..B-1], cache with the new
          context written; the block itself is never cached). Proposal slots are
          ``hidden[:, first_proposal_slot:]``; their base logits are ``target.logits(...)``.
        """
        b, block = anchor_tokens.shape[0], self.config.block_size
        block_positions = anchor_positions[:, None] + jnp.arange(block)[None, :]
        cos, sin = self.rope(block_positions)
        ctx = self.context(ctx_taps)
        ctx_cos, ctx_sin = self.rope(ctx_positions)
        # Every layer's keys and values of the new context (they do not depend on the block)
        # go into the cache first, so that each layer's block attention reads its layer of
        # the cache where it lies: on a CPU a kernel over the slots < anchor only
        # (fused_attention.attend_cache), where the einsum read every slot of a copy.
        _, (k_ctx, v_ctx) = self._layer_scan(
            lambda layer, _, carry: (carry, layer.self_attn.keys_values(ctx, ctx_cos, ctx_sin)),
            None)  # [L, b, C, K, D]
        cache = cache.write(k_ctx, v_ctx, ctx_positions)
        visible = jnp.broadcast_to(
            jnp.arange(cache.num_slots)[None, None, :] < anchor_positions[:, None, None],
            (b, block, cache.num_slots))
        own = jnp.ones((b, block, block), bool)  # inside a block attention is bidirectional

        def body(layer, index, h):
            attn = layer.self_attn
            x = layer.input_layernorm(h)
            q = attn.queries(x, cos, sin)
            k_block, v_block = attn.keys_values(x, cos, sin)
            out = attend_cache(q, cache.k, cache.v, visible, k_block, v_block, own, layer=index,
                               lengths=anchor_positions, scale=attn.scale,
                               transposed_keys=cache.transposed_keys)
            return layer.finish(h, out), None

        hidden, _ = self._layer_scan(body, self.block_embeddings(target, anchor_tokens))
        return DraftOutput(self.norm(hidden), cache)

    # -- training ------------------------------------------------------------------------------

    def forward_train(self, target: Decoder, *, input_ids: jax.Array, taps: jax.Array,
                      anchors: jax.Array, keep: jax.Array, loss_mask: jax.Array,
                      positions: jax.Array | None = None, segment_ids: jax.Array | None = None,
                      with_logits: bool = True, attention: str | None = None) -> TrainOutput:
        """Teacher-forced forward over many anchors per sequence (spec 4.2-4.8).

        Args:
          target: the target decoder (embedding and LM head, frozen).
          input_ids: int [b, S]; taps: [b, S, m*d] raw target taps; loss_mask: [b, S].
          anchors: int [b, N] sorted anchor indices; keep: bool [b, N] (False: dummy block).
          positions: int [b, S] context positions (default 0..S-1; per segment when packing).
          segment_ids: int [b, S] for packed rows (None: one sequence per row).
          with_logits: also return the full [b, N, B, V] logits (else compute them in chunks
            with :meth:`logits` from ``hidden`` and ``prev``).
          attention: the attention's implementation (``fused_attention.IMPLEMENTATIONS``; None:
            the backend's): cuDNN's flash attention on a GPU where it takes the inputs
            (bfloat16), the blockwise einsum elsewhere.

        Returns:
          TrainOutput; slot k of block j predicts input_ids[anchor_j + k + 1] (DeepSpec), or
          input_ids[anchor_j + k] for slots k >= 1 when ``anchor_predicts`` is False.
        """
        b, seq = input_ids.shape
        num_blocks, block = anchors.shape[1], self.config.block_size
        if positions is None:
            positions = jnp.broadcast_to(jnp.arange(seq), (b, seq))
        anchor_pos = jnp.take_along_axis(positions, anchors, axis=1)
        offsets = jnp.arange(block)
        block_positions = (anchor_pos[:, :, None] + offsets).reshape(b, num_blocks * block)
        cos, sin = self.rope(block_positions)
        ctx_cos, ctx_sin = self.rope(positions)
        anchor_tokens = jnp.take_along_axis(input_ids, anchors, axis=1)
        h = self.block_embeddings(target, anchor_tokens, keep).reshape(b, num_blocks * block, -1)
        mask = block_attention_mask(anchors=anchors, keep=keep, context_len=seq, block_size=block,
                                    segment_ids=segment_ids)
        hidden = self._run_layers(h, cos=cos, sin=sin, ctx=self.context(taps), ctx_cos=ctx_cos,
                                  ctx_sin=ctx_sin, mask=mask, attention=attention)
        hidden = hidden.reshape(b, num_blocks, block, -1)

        first = self.first_proposal_slot
        label_index = anchors[:, :, None] + offsets + (1 - first)  # [b, N, B]
        safe = jnp.minimum(label_index, seq - 1)

        def gather(x, index):
            return jnp.take_along_axis(x, index.reshape(b, -1), axis=1).reshape(index.shape)

        labels = gather(input_ids, safe).astype(jnp.int32)
        prev = gather(input_ids, jnp.clip(label_index - 1, 0, seq - 1)).astype(jnp.int32)
        valid = (label_index < seq) & gather(loss_mask.astype(bool), safe) & keep[:, :, None]
        if segment_ids is not None:
            valid &= gather(segment_ids, safe) == jnp.take_along_axis(segment_ids, anchors, 1)[:, :, None]
        proposal = offsets >= first
        eval_mask = jnp.cumprod(valid | ~proposal, axis=-1).astype(bool) & proposal
        logits = self.logits(target, hidden, prev) if with_logits else None
        return TrainOutput(hidden, prev, labels, eval_mask, logits, self.confidence(hidden, prev))
