"""Causal attention within packed segments, through fused kernels on accelerators.

The packed target forward of training and of the feature cache attends causally within
segments (``segment_ids``; 0 is padding) and, on sliding layers, within a window; the
drafter's training forward attends over its context and its own block
(:func:`attend_draft_blocks`). By backend:

* TPU, ``"splash"``: splash attention (Pallas; block-sparse, so key blocks above the diagonal or
  outside the window are skipped) with segment ids, one multi-query kernel per kv head;
* GPU, ``"cudnn"``: cuDNN's flash attention, causal with a left window, where cuDNN takes the
  inputs (:func:`cudnn_applies`: bfloat16 / float16, a head dim that is a multiple of 8 up to
  128, even lengths); other inputs take the einsum. The segments reach cuDNN as lengths, not as
  a mask (which cuDNN would read as a dense [B, 1, T, T] bias) where the caller bounds them
  (``max_segments``): one segment per row (a prefill, a feature-cache row) as
  ``jax.nn.dot_product_attention``'s sequence lengths; several (packed training rows) as
  cuDNN's packed layout, each segment's start and length (:func:`packed_segments`), through
  JAX's cuDNN module, whose ``dot_product_attention`` takes them (``jax.nn``'s does not). Without
  a bound, the dense mask. (JAX's own ``implementation=None`` means XLA's, which stores the
  scores, so it is never passed);
* CPU, ``"einsum"``: :func:`layers.attend` over the dense mask, the reference;
* CPU, ``"cpu"``: ``cpu_attention.attend_rows`` (x86 with AVX-512, float32, one segment per
  row: a prefill; no gradient), the default of inference prefills there
  (:func:`default_prefill_implementation`); other inputs take the einsum.

Decode and verify steps attend over the KV cache (:func:`attend_cache`). On a single GPU,
``"pallas"`` runs the cache part through JAX's Pallas (Triton) decode kernel
(``jax.experimental.pallas.ops.gpu.decode_attention``, flash decoding: each (row, kv head)
streams only its committed slots, split over 16 or more programs), with the T new tokens of a
verify folded into the query heads, and merges it with the T x T part by the softmax residuals.
Under a mesh the kernel runs per shard (``jax.shard_map`` over rows and kv heads, sharded as the
cache is: a Pallas call has no sharding rule of its own, so XLA would gather the whole cache to
every device). On an x86 CPU with AVX-512, ``"cpu"`` runs ``cpu_attention``'s FFI kernel over
float32 caches: it takes the whole stacked cache and the layer's index (the decoder's layer
scan passes them, ``kv_cache.StackedLayer``), so the layer is read where it lies instead of
copied out, and each row's committed slots only. Elsewhere the einsum
(:func:`layers.attend_cached`): on TPUs, on other CPUs, for sliding-window layers and for stacks
that mix layer types (Gemma3), whose lengths do not bound what a query sees.

``"xla"`` is ``jax.nn.dot_product_attention``'s portable implementation: the cuDNN route's
arguments, checkable on a CPU. Off a TPU, splash runs in Pallas' interpret mode (tests only).
Outputs at padding positions differ between implementations (a padding query sees nothing,
or other padding); nothing reads them.

Shapes: B rows, T tokens, H query heads, K kv heads, D head dim.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from dspark_jax.models import cpu_attention
from dspark_jax.models.kv_cache import slots_view
from dspark_jax.sharding import logical_to_spec
from dspark_jax.models.layers import attend, attend_blockwise, attend_cached, scores_of

IMPLEMENTATIONS = ("einsum", "xla", "cudnn", "splash", "cpu")
CACHE_IMPLEMENTATIONS = ("einsum", "pallas", "cpu")
SPLASH_BLOCKS = (512, 256, 128)  # splash block sizes, largest first; T must be a multiple of one


def default_implementation() -> str:
    """"splash" on a TPU, "cudnn" on a GPU, "einsum" elsewhere."""
    return {"tpu": "splash", "gpu": "cudnn"}.get(jax.default_backend(), "einsum")


def default_prefill_implementation() -> str:
    """An inference prefill's (no gradient): "cpu" where ``cpu_attention`` runs, else
    :func:`default_implementation`."""
    if jax.default_backend() == "cpu" and cpu_attention.available():
        return "cpu"
    return default_implementation()


def default_cache_implementation() -> str:
    """"pallas" on a GPU, "cpu" where ``cpu_attention`` runs (x86 with AVX-512), "einsum"
    elsewhere (:func:`attend_cache`)."""
    if jax.default_backend() == "gpu":
        return "pallas"
    return "cpu" if cpu_attention.available() else "einsum"


def cudnn_applies(q: jax.Array, *lengths: int) -> bool:
    """Whether cuDNN's flash attention takes these inputs: q [B, T, H, D] in bfloat16 or
    float16, D a multiple of 8 and at most 128 (256 on Hopper; 128 holds on every GPU), and
    even query / key lengths (``lengths``), which cuDNN asks of a masked attention in training."""
    d = q.shape[-1]
    return (q.dtype in (jnp.bfloat16, jnp.float16) and d % 8 == 0 and d <= 128
            and all(n % 2 == 0 for n in lengths))


def segment_mask(segment_ids: jax.Array, window: int | None = None) -> jax.Array:
    """int [B, T] segment ids -> bool [B, T, T]: query t sees key s when s <= t, both are in
    the same segment, the segment is not padding (0), and (with ``window``) t - s < window."""
    index = jnp.arange(segment_ids.shape[1])
    visible = index[None, :] <= index[:, None]
    if window is not None:
        visible &= index[None, :] > index[:, None] - window
    return visible[None] & _same_segment(segment_ids)


def _same_segment(segment_ids: jax.Array) -> jax.Array:
    """bool [B, T, T]: query t and key s are in the same segment, which is not padding."""
    return (segment_ids[:, :, None] == segment_ids[:, None, :]) & (segment_ids[:, None, :] != 0)


def attend_segments(q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array, *,
                    scale: float | None = None, window: int | None = None,
                    implementation: str | None = None,
                    max_segments: int | None = None) -> jax.Array:
    """Causal attention within segments.

    Args:
      q: [B, T, H, D]; k, v: [B, T, K, D] with H a multiple of K.
      segment_ids: int [B, T]; 0 marks padding.
      scale: the scores' scale (None: D ** -0.5).
      window: a query sees only the keys of its last ``window`` positions (None: all).
      implementation: one of ``IMPLEMENTATIONS`` (None: :func:`default_implementation`).
      max_segments: static; None, or a bound on the segments of a row when they are laid out
        as the pipeline packs them: numbered 1, 2, ... from column 0, each contiguous, padding
        (0) only after the last. "xla" and "cudnn" then take the segments as lengths instead of
        a dense mask (module docstring); segments beyond the bound would be left out (their
        outputs zeros), so the bound must hold.

    Returns:
      [B, T, H, D] in q's dtype (at real positions the same for every implementation, to
      float tolerance).
    """
    impl = implementation or default_implementation()
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    if impl == "cudnn" and not cudnn_applies(q, q.shape[1]):
        impl = "einsum"
    def einsum(q, k, v, *_):
        return attend(q, k, v, segment_mask(segment_ids, window), scale=scale)

    if impl == "cpu":
        if max_segments == 1 and cpu_attention.applies_rows(q, k, v):
            lengths = jnp.sum(segment_ids != 0, axis=1, dtype=jnp.int32)
            return cpu_attention.attend_rows(q, k, v, lengths, scale=scale, window=window,
                                             otherwise=einsum)
        impl = "einsum"
    if impl == "einsum":
        return einsum(q, k, v)
    if impl in ("xla", "cudnn"):
        left = None if window is None else (window - 1, 0)
        if max_segments == 1:  # a row's tokens come first: its length is the whole mask
            lengths = jnp.sum(segment_ids != 0, axis=1, dtype=jnp.int32)
            out = jax.nn.dot_product_attention(
                q, k, v, scale=scale, is_causal=True, query_seq_lengths=lengths,
                key_value_seq_lengths=lengths, local_window_size=left, implementation=impl)
        elif impl == "cudnn" and max_segments is not None:
            out = _cudnn_packed(q, k, v, segment_ids, max_segments, scale, window)
        else:
            return jax.nn.dot_product_attention(
                q, k, v, mask=_same_segment(segment_ids)[:, None], scale=scale, is_causal=True,
                local_window_size=left, implementation=impl)
        # Padding queries see no key; what a kernel leaves there is not defined: zeros.
        return jnp.where((segment_ids != 0)[:, :, None, None], out, 0).astype(q.dtype)
    if impl == "splash":
        return _splash(q, k, v, segment_ids, scale, window)
    raise ValueError(f"unknown attention implementation {impl!r}; choose one of "
                     f"{', '.join(IMPLEMENTATIONS)}")


def packed_segments(segment_ids: jax.Array, max_segments: int) -> tuple[jax.Array, jax.Array]:
    """Packed rows' segments as starts and lengths, the layout cuDNN's packed attention reads.

    Args:
      segment_ids: int [B, T], numbered 1, 2, ... from column 0, each contiguous; 0 padding.
      max_segments: M, static; a row's segments beyond M are left out.

    Returns:
      (starts int32 [B, M + 1], lengths int32 [B, M]): segment m + 1 of row b covers columns
      starts[b, m] .. starts[b, m] + lengths[b, m] - 1; -1 where a row has fewer segments, and
      in the last start column (cuDNN's convention).
    """
    ids = jnp.arange(1, max_segments + 1, dtype=segment_ids.dtype)
    member = segment_ids[:, None, :] == ids[None, :, None]  # [B, M, T]
    lengths = jnp.sum(member, axis=-1, dtype=jnp.int32)
    starts = jnp.argmax(member, axis=-1).astype(jnp.int32)
    present = lengths > 0
    starts = jnp.where(present, starts, -1)
    starts = jnp.concatenate([starts, jnp.full((starts.shape[0], 1), -1, jnp.int32)], axis=1)
    return starts, jnp.where(present, lengths, -1)


def _cudnn_packed(q, k, v, segment_ids, max_segments: int, scale: float,
                  window: int | None) -> jax.Array:
    """:func:`attend_segments` through cuDNN's packed layout: each segment its own causal
    sequence at its start (JAX's cuDNN module; ``jax.nn.dot_product_attention`` does not take
    segment starts). Off-segment outputs are not written: the caller masks them."""
    from jax._src.cudnn import fused_attention_stablehlo as cudnn

    starts, lengths = packed_segments(segment_ids, max_segments)
    return cudnn.dot_product_attention(
        q, k, v, q_seqlen=lengths, kv_seqlen=lengths, q_offsets=starts, kv_offsets=starts,
        scale=scale, mask_type=cudnn.MaskType.PADDING_CAUSAL, sliding_window_length=window)


def attend_draft_blocks(q: jax.Array, k_ctx: jax.Array, v_ctx: jax.Array, ctx_mask: jax.Array,
                        k_block: jax.Array, v_block: jax.Array, keep: jax.Array, *,
                        block_size: int, scale: float | None = None,
                        implementation: str | None = None) -> jax.Array:
    """The drafter's training attention (spec 4.4): each block token attends to the context
    keys its mask allows (strictly before its anchor, in its segment) and to every token of
    its own block.

    Args:
      q: [B, T, H, D] queries of T = n * block_size block tokens.
      k_ctx, v_ctx: [B, S, K, D] the context's keys and values; ctx_mask: bool [B, T, S].
      k_block, v_block: [B, T, K, D] the blocks' own keys and values.
      keep: bool [B, T]; False: the token sees no key of its block (a dummy block).
      block_size: tokens per block.
      scale: the scores' scale (None: D ** -0.5).
      implementation: ``"cudnn"`` runs cuDNN's flash attention over the keys [context;
        blocks] with the dense mask as a bias (the scores are never stored) where
        :func:`cudnn_applies`, else the einsum; ``"xla"`` runs jax.nn.dot_product_attention's
        XLA implementation over the same keys and mask (it stores the [B, H, T, S + T] scores:
        the cuDNN route's arguments, checkable on a CPU); ``"einsum"`` and ``"splash"`` run
        ``layers.attend_blockwise``, which stores scores only against the context and the own
        block (splash takes only masks fixed at trace time, and this one depends on the
        batch's anchors); so does ``"cpu"``, whose kernel only serves prefills. None:
        :func:`default_implementation`.

    Returns:
      [B, T, H, D]; a token that sees no key gets zeros.
    """
    impl = implementation or default_implementation()
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    if impl == "cudnn" and not cudnn_applies(q, q.shape[1], k_ctx.shape[1] + q.shape[1]):
        impl = "einsum"
    if impl in ("einsum", "splash", "cpu"):
        return attend_blockwise(q, k_ctx.transpose(0, 2, 3, 1), v_ctx.swapaxes(1, 2), ctx_mask,
                                k_block, v_block, keep, block_size=block_size, scale=scale)
    if impl not in ("xla", "cudnn"):
        raise ValueError(f"unknown attention implementation {impl!r}; choose one of "
                         f"{', '.join(IMPLEMENTATIONS)}")
    block = jnp.arange(q.shape[1]) // block_size
    own = (block[:, None] == block[None, :])[None] & keep[:, :, None]  # [B, T, T]
    mask = jnp.concatenate([ctx_mask, own], axis=-1)  # [B, T, S + T]
    out = jax.nn.dot_product_attention(
        q, jnp.concatenate([k_ctx, k_block], axis=1), jnp.concatenate([v_ctx, v_block], axis=1),
        mask=mask[:, None], scale=scale, implementation=impl)
    return jnp.where(mask.any(-1)[:, :, None, None], out, 0).astype(q.dtype)


def _splash(q, k, v, segment_ids, scale: float, window: int | None) -> jax.Array:
    """:func:`attend_segments` by splash attention: per row and kv head, a multi-query kernel
    over that head's G query heads."""
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as sm

    b, t, h, d = q.shape
    kv = k.shape[2]
    g = h // kv
    block = next((size for size in SPLASH_BLOCKS if t % size == 0), None)
    if block is None:
        raise ValueError(f"splash attention needs a sequence length that is a multiple of "
                         f"{SPLASH_BLOCKS[-1]}, got {t}")
    causal = (sm.CausalMask((t, t)) if window is None else
              sm.LocalMask((t, t), window_size=(window - 1, 0), offset=0))
    sizes = sk.BlockSizes(block_q=block, block_kv=block, block_kv_compute=block, block_q_dkv=block,
                          block_kv_dkv=block, block_kv_dkv_compute=block, block_q_dq=block,
                          block_kv_dq=block)
    kernel = sk.make_splash_mqa_single_device(sm.MultiHeadMask([causal] * g), block_sizes=sizes,
                                              interpret=jax.default_backend() != "tpu")

    def one(q_head, k_head, v_head, ids):  # [G, T, D], [T, D], [T, D], int [T]
        return kernel(q_head, k_head, v_head, segment_ids=sk.SegmentIds(q=ids, kv=ids))

    qg = (q * jnp.asarray(scale, q.dtype)).reshape(b, t, kv, g, d).transpose(0, 2, 3, 1, 4)
    per_head = jax.vmap(one, in_axes=(0, 0, 0, None))
    out = jax.vmap(per_head)(qg, k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3),
                             segment_ids.astype(np.int32))  # [B, K, G, T, D]
    return out.transpose(0, 3, 1, 2, 4).reshape(b, t, h, d).astype(q.dtype)


def attend_cache(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, cache_visible: jax.Array,
                 k_new: jax.Array, v_new: jax.Array, new_visible: jax.Array, *,
                 layer: jax.Array | None = None, lengths: jax.Array | None = None,
                 view: int | None = None, scale: float | None = None,
                 transposed_keys: bool = True, implementation: str | None = None) -> jax.Array:
    """Attention of T new tokens per row over one layer of the KV cache and over each other.

    Args:
      q: [B, T, H, D] queries of the new tokens.
      k_cache, v_cache: one layer of the cache (kv_cache.py layout): keys [B, K, D, N]
        (``transposed_keys``) or [B, K, N, D], values [B, K, N, D]; read in the new keys' and
        values' dtype. With ``layer`` (int [], traced) the whole stacks [L, ...] instead, of
        which layer ``layer`` is read.
      cache_visible: bool [B, T, view], True where query t may see slot s (the einsum's mask).
      k_new, v_new: [B, T, K, D] the new tokens' keys / values; new_visible: bool [B, T, T].
      lengths: int [B] when every query of row b sees exactly the slots < lengths[b] (a
        full-attention layer): the kernel then reads only those; None (a sliding window): the
        einsum over ``cache_visible``.
      view: read only the first ``view`` slots (None: all N); every length is at most ``view``.
      scale: the scores' scale (None: D ** -0.5).
      transposed_keys: the layout of ``k_cache``.
      implementation: one of ``CACHE_IMPLEMENTATIONS`` (None: :func:`default_cache_implementation`);
        "pallas" falls back to the einsum where the kernel does not apply: keys [B, K, D, N],
        no ``lengths``, or a view and head dim the kernel cannot tile
        (:func:`pallas_cache_split`). Under a mesh of several devices it runs per shard
        (:func:`_per_shard`). Off a GPU the kernel runs in Pallas' interpret mode (tests only).
        "cpu" (``cpu_attention``: the stacks read in place, only the slots < ``lengths``) falls
        back to the einsum without ``layer`` or ``lengths`` or where ``cpu_attention.applies``
        does not hold (another dtype than float32, keys [.., N, D]); it ignores ``view``.

    Returns:
      [B, T, H, D]; a query with no visible key gets zeros.
    """
    impl = implementation or default_cache_implementation()
    if impl not in CACHE_IMPLEMENTATIONS:
        raise ValueError(f"unknown cache attention implementation {impl!r}; choose one of "
                         f"{', '.join(CACHE_IMPLEMENTATIONS)}")
    if layer is not None:
        if (impl == "cpu" and lengths is not None
                and cpu_attention.applies(q, k_cache, v_cache, k_new, v_new, transposed_keys)):
            def einsum(q, k_cache, v_cache, layer, lengths, k_new, v_new, new_visible):
                return attend_cache(q, k_cache, v_cache, cache_visible, k_new, v_new, new_visible,
                                    layer=layer, lengths=lengths, view=view, scale=scale,
                                    transposed_keys=transposed_keys, implementation="einsum")
            return cpu_attention.attend(q, k_cache, v_cache, layer, lengths, k_new, v_new,
                                        new_visible, otherwise=einsum,
                                        scale=q.shape[-1] ** -0.5 if scale is None else scale)
        k_cache, v_cache = (jax.lax.dynamic_index_in_dim(x, layer, keepdims=False)
                            for x in (k_cache, v_cache))
    if view is not None:
        k_cache = slots_view(k_cache, view, transposed_keys=transposed_keys)
        v_cache = slots_view(v_cache, view, transposed_keys=False)
    k_cache, v_cache = k_cache.astype(k_new.dtype), v_cache.astype(v_new.dtype)
    split = pallas_cache_split(v_cache.shape[2], q.shape[-1])
    if impl == "pallas" and lengths is not None and not transposed_keys and split:
        kernel = functools.partial(_pallas_cache, split=split,
                                   scale=q.shape[-1] ** -0.5 if scale is None else scale)
        mesh = jax.sharding.get_abstract_mesh()
        if not mesh.empty and mesh.size > 1:
            kernel = _per_shard(kernel, mesh, rows=q.shape[0], kv_heads=v_cache.shape[1])
        return kernel(q, k_cache, v_cache, lengths, k_new, v_new, new_visible)
    return attend_cached(q, k_cache, v_cache, cache_visible, k_new, v_new, new_visible,
                         scale=scale, transposed_keys=transposed_keys)


def _per_shard(kernel, mesh, *, rows: int, kv_heads: int):
    """``kernel`` (the arguments of :func:`_pallas_cache`) run on each device's shard of rows
    and kv heads, split as the logical axis rules split the cache ("batch", "kv_heads"; an axis
    that does not divide evenly stays whole). A device's query heads are those of its kv heads
    (query head h belongs to kv head h // G, so equal contiguous shards of both agree); the
    slots are never split, so every shard sees its rows' whole committed prefix."""
    batch = logical_to_spec(("batch",), (rows,), mesh)[0]
    heads = logical_to_spec(("kv_heads",), (kv_heads,), mesh)[0]
    by_head = P(batch, None, heads, None)  # q, k_new, v_new [B, T, H or K, D]; the output
    cache = P(batch, heads, None, None)  # [B, K, N, D]
    return jax.shard_map(kernel, mesh=mesh, out_specs=by_head, check_vma=False,
                         in_specs=(by_head, cache, cache, P(batch), by_head, by_head, P(batch)))


MAX_CACHE_PROGRAMS = 64  # more splits of a row's slots: the kernel's final sum gets long


def pallas_cache_split(num_slots: int, head_dim: int) -> int | None:
    """Slots per program of the Pallas decode kernel over ``num_slots`` cache slots: the
    largest power of two (at least 16) dividing ``num_slots`` that leaves at least 16 programs
    (fewer when the cache is short); None where the kernel does not apply: ``num_slots`` not
    a multiple of 16, more than ``MAX_CACHE_PROGRAMS`` programs, or a head dim that is not a
    power of two from 16 to 512 (Triton's blocks are powers of two; see :func:`_block_k`)."""
    if num_slots % 16 or not 16 <= head_dim <= 512 or head_dim & (head_dim - 1):
        return None
    split = 16
    while num_slots % (2 * split) == 0 and num_slots // (2 * split) >= 16:
        split *= 2
    return split if num_slots // split <= MAX_CACHE_PROGRAMS else None


def _block_k(split: int, head_dim: int) -> int:
    """Slots per step of a program: at most 128, and at most 16,384 / head dim, so that the
    key and value tiles of two pipeline stages fit a GPU's shared memory (128 KiB in bfloat16)."""
    return min(split, 128, 16384 // head_dim)


def _pallas_cache(q, k_cache, v_cache, lengths, k_new, v_new, new_visible, *, scale: float,
                  split: int) -> jax.Array:
    """:func:`attend_cache` by the Pallas decode kernel: per (row, kv head) one multi-query
    attention of its T * G queries (the T new tokens folded into the G query heads) over the
    row's committed slots, with its softmax residuals (sum l, max m), merged with the new
    tokens' T x T part as one softmax."""
    from jax.experimental.pallas.ops.gpu import decode_attention

    b, t, h, d = q.shape
    kv, n = v_cache.shape[1], v_cache.shape[2]
    g = h // kv
    rows = b * kv

    def per_head(x):  # [B, T, K, D] -> [B * K, T, D]
        return x.swapaxes(1, 2).reshape(rows, t, d)

    qg = q.reshape(b, t, kv, g, d).swapaxes(1, 2).reshape(rows, t * g, d)  # index t * G + g
    o, (l, m) = decode_attention.mqa(
        qg, k_cache.reshape(rows, n, d), v_cache.reshape(rows, n, d),
        kv_seq_len=jnp.repeat(lengths.astype(jnp.int32), kv), sm_scale=scale, k_splits=n // split,
        block_k=_block_k(split, d), interpret=jax.default_backend() != "gpu",
        return_residuals=True)  # o [B*K, T*G, D] = sum exp(s - m) v / l, l = sum exp(s - m)
    # (normalised in the kernel: an unnormalised sum could overflow float16)
    s_own = scores_of(qg, per_head(k_new), "nqd,nsd->nqs", scale)  # [B*K, T*G, T]
    visible = jnp.broadcast_to(new_visible[:, None, :, None, :], (b, kv, t, g, t))
    visible = visible.reshape(rows, t * g, t)
    peak = jnp.maximum(m, jnp.max(jnp.where(visible, s_own, -jnp.inf), axis=-1))
    w_own = jnp.where(visible, jnp.exp(s_own - peak[..., None]), 0.0)
    carried = jnp.exp(m - peak)  # the cache part's weights, rescaled to the common peak
    total = o.astype(jnp.float32) * (l * carried)[..., None] + jnp.einsum(
        "nqs,nsd->nqd", w_own, per_head(v_new).astype(jnp.float32))
    denom = l * carried + w_own.sum(-1)
    out = total / jnp.where(denom > 0, denom, 1.0)[..., None]
    return out.reshape(b, kv, t, g, d).swapaxes(1, 2).reshape(b, t, h, d).astype(q.dtype)
