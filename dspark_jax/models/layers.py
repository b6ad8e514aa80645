"""Building blocks shared by the target decoder and the drafter.

RMSNorm (Llama's, and Gemma's 1 + weight), linear layers with logical axis names, rotary
embeddings in the Hugging Face ``rotate_half`` layout (with the rope scaling types of Llama 3,
Qwen2 and Qwen3 configs), a GQA attention core over an explicit boolean mask (with Gemma's
query scaling), and the gated MLP (SiLU, or Gemma's tanh GELU).

Shapes: B batch, T query tokens, S key tokens, H query heads, K key/value heads,
D head dim, d hidden size, I MLP width.
"""

from __future__ import annotations

import functools
import math
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dspark_jax.model_config import FULL, attention_dims
from dspark_jax.models import cpu_kernels, cpu_matmul
from dspark_jax.models.layer_weights import LayerKernel

INIT_STD = 0.02


def _param(rngs: nnx.Rngs | None, shape, dtype, names, init="normal") -> nnx.Param:
    """A parameter carrying logical axis names (``out_sharding`` metadata, applied lazily)."""
    if init == "ones":
        value = jnp.ones(shape, dtype)
    elif init == "zeros":
        value = jnp.zeros(shape, dtype)
    else:
        value = (INIT_STD * jax.random.normal(rngs.params(), shape, jnp.float32)).astype(dtype)
    return nnx.Param(value, sharding_names=tuple(names), eager_sharding=False)


class RMSNorm(nnx.Module):
    """y = weight * x / sqrt(mean(x^2) + eps), normalised in float32 as in transformers.

    The mean square is ``cpu_matmul.row_sum``'s: on a CPU with the kernel each row is summed
    in one fixed order, so a token's norm has the same bits in a verify as in its decode step
    and in any batch (XLA:CPU's reduction orders a row's sum by the number of rows).

    With ``offset`` 1.0 (Gemma) the scale is 1 + weight, applied in float32 before the cast back
    (transformers' Gemma3RMSNorm); the stored weight then starts at zeros.
    """

    def __init__(self, dim: int, eps: float, *, dtype, axis_name: str = "norm", offset: float = 0.0,
                 with_scale: bool = True):
        self.eps = eps
        self.offset = offset
        self.weight = (_param(None, (dim,), dtype, (axis_name,), init="zeros" if offset else "ones")
                       if with_scale else None)

    def __call__(self, x: jax.Array) -> jax.Array:
        """x: [..., dim] -> [..., dim] in x.dtype (without a weight: only normalised, as
        Gemma4's value norm)."""
        xf = x.astype(jnp.float32)
        mean_square = cpu_matmul.row_sum(xf * xf)[..., None] / xf.shape[-1]  # rows independent
        xf = xf * jax.lax.rsqrt(mean_square + self.eps)
        if self.weight is None:
            return xf.astype(x.dtype)
        if self.offset:
            return (xf * (self.offset + self.weight[...].astype(jnp.float32))).astype(x.dtype)
        return self.weight[...] * xf.astype(x.dtype)


class Embedding(nnx.Module):
    """Token embedding table [V, d]; ``attend`` gives the tied LM head."""

    def __init__(self, vocab: int, dim: int, *, dtype, rngs: nnx.Rngs):
        self.embedding = _param(rngs, (vocab, dim), dtype, ("vocab", "embed"))

    def __call__(self, tokens: jax.Array) -> jax.Array:
        """int [...] -> [..., d]."""
        return jnp.take(self.embedding[...], tokens, axis=0)


class Linear(nnx.Module):
    """y = x @ kernel (+ bias); kernel [in, out] (the transpose of torch's weight)."""

    def __init__(self, d_in: int, d_out: int, *, names: tuple[str, str], dtype,
                 rngs: nnx.Rngs, bias: bool = False):
        self.kernel = _param(rngs, (d_in, d_out), dtype, names)
        self.bias = _param(None, (d_out,), dtype, names[1:], init="zeros") if bias else None

    def __call__(self, x: jax.Array) -> jax.Array:
        """x [..., in] -> [..., out] in x's dtype. A kernel held in another dtype than x
        (bfloat16 weights under float32 activations, ``layer_weights.with_dtype``) multiplies x
        rounded to the kernel's dtype and accumulates in x's, on at least :data:`MIN_ROWS`
        rows (:func:`with_min_rows`)."""
        kernel = self.kernel.get_value()
        if kernel.dtype != x.dtype:
            x, accumulate = x.astype(kernel.dtype), x.dtype
        else:
            accumulate = None

        def product(x):
            if isinstance(kernel, LayerKernel):  # one layer of per-layer arrays, read in place
                return kernel.einsum("...i,io->...o", x, preferred_element_type=accumulate)
            if cpu_kernels.unsharded() and cpu_matmul.applies(x, kernel, accumulate):
                return cpu_matmul.matmul(x, kernel)  # a few rows on a CPU (a drafter's context)
            return jnp.einsum("...i,io->...o", x, kernel, preferred_element_type=accumulate)

        y = product(x) if accumulate is None else with_min_rows(product, x)
        return y if self.bias is None else y + self.bias[...]


# XLA:CPU's bfloat16 x bfloat16 -> float32 matmul gives a row the same bits for any number of
# rows from 3 on, but others (and slowly: a matrix-vector kernel) for 1 or 2 rows.
MIN_ROWS = 3


def with_min_rows(product, x: jax.Array) -> jax.Array:
    """``product(x)`` for x [..., in] -> [..., out], computed on at least :data:`MIN_ROWS` rows
    (x flattened to [rows, in], zero rows appended, then dropped), so that a bfloat16 product
    of a decode step's single token equals that of the same token in a batch or a verify."""
    lead, n = x.shape[:-1], int(np.prod(x.shape[:-1]))
    if n >= MIN_ROWS:
        return product(x)
    padded = jnp.zeros((MIN_ROWS, x.shape[-1]), x.dtype).at[:n].set(x.reshape(n, -1))
    return product(padded)[:n].reshape(*lead, -1)


ACTIVATIONS = {"silu": jax.nn.silu,
               "gelu_pytorch_tanh": functools.partial(jax.nn.gelu, approximate=True)}


class MLP(nnx.Module):
    """down(act(gate(x)) * up(x)): [..., d] -> [..., d]; act is SiLU or tanh GELU (Gemma)."""

    def __init__(self, d: int, inner: int, *, dtype, rngs: nnx.Rngs, bias: bool = False,
                 activation: str = "silu"):
        self.activation = activation
        self.gate_proj = Linear(d, inner, names=("embed", "mlp"), dtype=dtype, rngs=rngs, bias=bias)
        self.up_proj = Linear(d, inner, names=("embed", "mlp"), dtype=dtype, rngs=rngs, bias=bias)
        self.down_proj = Linear(inner, d, names=("mlp", "embed"), dtype=dtype, rngs=rngs, bias=bias)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.down_proj(ACTIVATIONS[self.activation](self.gate_proj(x)) * self.up_proj(x))


# ----------------------------------------------------------------------------- rotary embeddings


def rope_frequencies(head_dim: int, theta: float, scaling: dict,
                     max_position_embeddings: int) -> tuple[np.ndarray, float]:
    """Inverse frequencies [D/2] and the cos/sin scale, as transformers computes them.

    Supports rope_type "default", "linear", "llama3" and "yarn" (the types used by Llama 3.x,
    Qwen2 and Qwen3 checkpoints) and Gemma4's "proportional": only the first
    ``partial_rotary_factor`` of the frequencies rotate (the exponents still over head_dim); the
    others are 0, so those dimensions keep their values.
    """
    scaling = dict(scaling or {})
    rope_type = scaling.get("rope_type", "default")
    inv_freq = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    if rope_type == "default":
        return inv_freq.astype(np.float32), 1.0
    if rope_type == "proportional":
        rotated = int(scaling.get("partial_rotary_factor", 1.0) * head_dim // 2)
        inv_freq = np.where(np.arange(head_dim // 2) < rotated, inv_freq, 0.0)
        return (inv_freq / scaling.get("factor", 1.0)).astype(np.float32), 1.0
    factor = float(scaling["factor"])
    if rope_type == "linear":
        return (inv_freq / factor).astype(np.float32), 1.0
    original = scaling.get("original_max_position_embeddings") or max_position_embeddings
    if rope_type == "llama3":
        low_wavelen = original / scaling["low_freq_factor"]
        high_wavelen = original / scaling["high_freq_factor"]
        wavelen = 2 * math.pi / inv_freq
        scaled = np.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (original / wavelen - scaling["low_freq_factor"]) / (
            scaling["high_freq_factor"] - scaling["low_freq_factor"])
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return np.where(medium, smoothed, scaled).astype(np.float32), 1.0
    if rope_type == "yarn":
        def mscale(scale, m=1.0):
            return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

        attention_factor = scaling.get("attention_factor")
        if attention_factor is None:
            if scaling.get("mscale") and scaling.get("mscale_all_dim"):
                attention_factor = mscale(factor, scaling["mscale"]) / mscale(
                    factor, scaling["mscale_all_dim"])
            else:
                attention_factor = mscale(factor)
        beta_fast = scaling.get("beta_fast") or 32
        beta_slow = scaling.get("beta_slow") or 1

        def correction_dim(rotations):
            return head_dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

        low, high = correction_dim(beta_fast), correction_dim(beta_slow)
        if scaling.get("truncate", True):
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, head_dim - 1)
        if low == high:
            high += 0.001
        ramp = np.clip((np.arange(head_dim // 2, dtype=np.float32) - low) / (high - low), 0, 1)
        extrapolation = 1 - ramp
        inv = inv_freq.astype(np.float32)
        mixed = (inv / factor) * (1 - extrapolation) + inv * extrapolation
        return mixed.astype(np.float32), float(attention_factor)
    raise ValueError(f"unsupported rope_type {rope_type!r}")


def rope_cos_sin(positions: jax.Array, inv_freq: np.ndarray, scale: float):
    """positions int [..., T] -> (cos, sin) float32 [..., T, D] in the rotate_half layout."""
    angles = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)
    angles = jnp.concatenate([angles, angles], axis=-1)
    return jnp.cos(angles) * scale, jnp.sin(angles) * scale


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """x [B, T, N, D] with cos/sin [B, T, D] -> rotated x (computed in float32, cast back).

    x cos + rot(x) sin is summed by ``cpu_matmul.row_sum`` (on a CPU with the kernel: the two
    rounded products added once): XLA:CPU contracts one of the products into the sum as a fused
    multiply-add, which one depending on the fusion around it, so the same token's keys got
    other bits in a verify laid out as a grid than in one scattered into it (BENCHMARKS.md)."""
    xf = x.astype(jnp.float32)
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-xf[..., half:], xf[..., :half]], axis=-1)
    products = jnp.stack([xf * cos[:, :, None, :], rotated * sin[:, :, None, :]], axis=-1)
    return cpu_matmul.row_sum(products).astype(x.dtype)


# ----------------------------------------------------------------------------- attention


QUERY_CHUNK = 512  # queries per attention chunk of long inputs (prefill)


def scores_of(q: jax.Array, k: jax.Array, subscripts: str, scale: float | None) -> jax.Array:
    """Attention logits in float32: ``einsum(subscripts, q, k) * scale`` (scale None:
    D ** -0.5)."""
    s = jnp.einsum(subscripts, q, k, preferred_element_type=jnp.float32)
    return s * (q.shape[-1] ** -0.5 if scale is None else scale)


def attend(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array, *,
           query_chunk: int = QUERY_CHUNK, scale: float | None = None) -> jax.Array:
    """Grouped-query attention over an explicit mask.

    Args:
      q: [B, T, H, D]; k, v: [B, S, K, D] with H a multiple of K.
      mask: bool [B, T, S], True where query t may see key s.
      scale: the scores' scale (None: D ** -0.5).
      query_chunk: when T is a larger multiple of it, queries are attended ``query_chunk`` at a
        time (``lax.map``), so the scores take [B, H, query_chunk, S] instead of [B, H, T, S]
        (a 4,096-token prefill of 10 prompts would otherwise need 29 GB). Each query's softmax
        is its own, so the result is the same.

    Returns:
      [B, T, H, D]. A query with no visible key gets zeros (safe softmax), not NaN.
    """
    b, t, h, d = q.shape
    if t > query_chunk and t % query_chunk == 0:
        n = t // query_chunk
        chunks = (q.reshape(b, n, query_chunk, h, d).swapaxes(0, 1),
                  mask.reshape(b, n, query_chunk, mask.shape[-1]).swapaxes(0, 1))
        out = jax.lax.map(lambda c: _attend(c[0], k, v, c[1], scale), chunks)
        return out.swapaxes(0, 1).reshape(b, t, h, d)  # [n, B, chunk, H, D] -> [B, T, H, D]
    return _attend(q, k, v, mask, scale)


def _attend(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array, scale) -> jax.Array:
    """:func:`attend` of all queries at once."""
    b, t, h, d = q.shape
    kv = k.shape[2]
    qg = q.reshape(b, t, kv, h // kv, d)
    scores = scores_of(qg, k, "btkgd,bskd->bkgts", scale)
    visible = mask[:, None, None, :, :]
    scores = jnp.where(visible, scores, -jnp.inf)
    peak = jnp.max(scores, axis=-1, keepdims=True)
    weights = jnp.exp(scores - jnp.where(jnp.isfinite(peak), peak, 0.0))
    weights = jnp.where(visible, weights, 0.0)
    denom = jnp.sum(weights, axis=-1, keepdims=True)
    weights = weights / jnp.where(denom > 0, denom, 1.0)
    out = jnp.einsum("bkgts,bskd->btkgd", weights.astype(v.dtype), v)
    return out.reshape(b, t, h, d)


def softmax_parts(scores: Sequence[jax.Array]) -> list[jax.Array]:
    """One softmax over several score arrays as if concatenated on their last axis.

    Masked entries are -inf; a row with no finite entry gets all-zero weights (not NaN). The
    attention cores use it to attend to keys held in separate arrays without concatenating them.

    Args:
      scores: float32 arrays [..., S_i] with the same leading shape.

    Returns:
      The weights [..., S_i] of each part; over all parts a row sums to 1 (or 0).
    """
    peak = functools.reduce(jnp.maximum, [jnp.max(s, axis=-1, keepdims=True) for s in scores])
    peak = jnp.where(jnp.isfinite(peak), peak, 0.0)
    weights = [jnp.exp(s - peak) for s in scores]  # masked entries are exp(-inf) = 0
    denom = sum(jnp.sum(w, axis=-1, keepdims=True) for w in weights)
    denom = jnp.where(denom > 0, denom, 1.0)
    return [w / denom for w in weights]


def attend_cached(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, cache_visible: jax.Array,
                  k_new: jax.Array, v_new: jax.Array, new_visible: jax.Array, *,
                  scale: float | None = None, transposed_keys: bool = True) -> jax.Array:
    """Attention of new tokens over a KV cache and over each other, without concatenating them.

    The same result as :func:`attend` over keys [cache slots; new tokens] with the mask
    [cache_visible, new_visible], as one softmax in two parts: the cache is read in place in its
    layout (no copy of it per layer) and the new tokens' part is T x T.

    Args:
      q: [B, T, H, D] queries of the new tokens.
      k_cache, v_cache: [B, K, D, S] keys (``transposed_keys``; else [B, K, S, D]) and
        [B, K, S, D] values, one layer of the cache (kv_cache.py layout).
      cache_visible: bool [B, T, S], True where query t may see slot s.
      k_new, v_new: [B, T, K, D] the new tokens' keys / values; new_visible: bool [B, T, T].
      scale: the scores' scale (None: D ** -0.5).
      transposed_keys: the layout of ``k_cache``.

    Returns:
      [B, T, H, D]; a query with no visible key gets zeros.
    """
    b, t, h, d = q.shape
    kv = k_cache.shape[1]
    g = h // kv
    # Rows of one kv head: its G query heads for each new token, q index = t * G + g.
    qg = q.reshape(b, t, kv, g, d).swapaxes(1, 2).reshape(b, kv, t * g, d)
    k_own, v_own = k_new.transpose(0, 2, 3, 1), v_new.swapaxes(1, 2)  # [B, K, D, T], [B, K, T, D]
    parts = [(k_cache, v_cache, cache_visible, transposed_keys)] if v_cache.shape[2] else []
    parts.append((k_own, v_own, new_visible, True))
    scores = []
    for keys, _, visible, transposed in parts:
        s = scores_of(qg, keys, "bkqd,bkds->bkqs" if transposed else "bkqd,bksd->bkqs", scale)
        s = s.reshape(b, kv, t, g, -1)
        scores.append(jnp.where(visible[:, None, :, None, :], s, -jnp.inf))
    out = sum(jnp.einsum("bkqs,bksd->bkqd", w.reshape(b, kv, t * g, -1).astype(values.dtype), values)
              for w, (_, values, _, _) in zip(softmax_parts(scores), parts))
    return out.reshape(b, kv, t, g, d).swapaxes(1, 2).reshape(b, t, h, d)


def attend_blockwise(q: jax.Array, k_ctx: jax.Array, v_ctx: jax.Array, ctx_mask: jax.Array,
                     k_block: jax.Array, v_block: jax.Array, block_keep: jax.Array, *,
                     block_size: int, scale: float | None = None,
                     transposed_keys: bool = True) -> jax.Array:
    """Attention of draft blocks over a shared context and, bidirectionally, their own block.

    The same result as :func:`attend` over keys [context; blocks] with the dense mask
    [ctx_mask, block-diagonal & block_keep], without materialising the block-to-block part:
    memory is O(T * (S + block_size)) instead of O(T * (S + T)), linear in the number of blocks.

    Args:
      q: [B, T, H, D] queries of T = n * block_size block tokens (block j = rows j*bs..).
      k_ctx, v_ctx: [B, K, D, S] context keys (``transposed_keys``; else [B, K, S, D]) and
        [B, K, S, D] values (the cache layout); ctx_mask: bool [B, T, S].
      k_block, v_block: [B, T, K, D] the blocks' own keys / values.
      block_keep: bool [B, T]; False: the query sees no key of its block (a dummy block).
      block_size: tokens per block.
      scale: the scores' scale (None: D ** -0.5).
      transposed_keys: the layout of ``k_ctx``.

    Returns:
      [B, T, H, D]; a query with no visible key gets zeros.
    """
    b, t, h, d = q.shape
    kv = k_ctx.shape[1]
    g, n = h // kv, t // block_size
    qg = q.reshape(b, t, kv, g, d)
    s_ctx = scores_of(qg, k_ctx, "btkgd,bkds->bkgts" if transposed_keys else "btkgd,bksd->bkgts",
                      scale)  # [B, K, G, T, S]
    s_blk = scores_of(qg.reshape(b, n, block_size, kv, g, d), k_block.reshape(b, n, block_size, kv, d),
                      "bnikgd,bnjkd->bkgnij", scale)
    s_blk = s_blk.reshape(b, kv, g, t, block_size)
    w_ctx, w_blk = softmax_parts([jnp.where(ctx_mask[:, None, None], s_ctx, -jnp.inf),
                                  jnp.where(block_keep[:, None, None, :, None], s_blk, -jnp.inf)])
    out = jnp.einsum("bkgts,bksd->btkgd", w_ctx.astype(v_ctx.dtype), v_ctx)
    w_blk = w_blk.astype(v_block.dtype).reshape(b, kv, g, n, block_size, block_size)
    out_blk = jnp.einsum("bkgnij,bnjkd->bnikgd", w_blk, v_block.reshape(b, n, block_size, kv, d))
    return (out + out_blk.reshape(b, t, kv, g, d)).reshape(b, t, h, d)


class Attention(nnx.Module):
    """Projections of a Llama / Qwen2 / Qwen3 / Gemma3 / Gemma4 attention layer (q/k/v bias,
    per-head q/k norm; Gemma4's value norm and, on its full layers, values from the key
    projection), with the scale of its attention scores (``scale``: query_pre_attn_scalar ** -1/2).

    The attention core is :func:`attend`, so the target and the drafter (whose keys also come
    from injected context features) share every weight layout.
    """

    def __init__(self, cfg, *, dtype, rngs: nnx.Rngs, layer_type: str = FULL):
        d, h = cfg.hidden_size, cfg.num_attention_heads
        kv, hd, k_eq_v = attention_dims(cfg, layer_type)
        self.num_heads, self.num_kv_heads, self.head_dim = h, kv, hd
        self.scale = cfg.query_pre_attn_scalar ** -0.5
        self.q_proj = Linear(d, h * hd, names=("embed", "q_heads"), dtype=dtype, rngs=rngs, bias=cfg.qkv_bias)
        self.k_proj = Linear(d, kv * hd, names=("embed", "kv_heads"), dtype=dtype, rngs=rngs, bias=cfg.qkv_bias)
        self.v_proj = (None if k_eq_v else
                       Linear(d, kv * hd, names=("embed", "kv_heads"), dtype=dtype, rngs=rngs,
                              bias=cfg.qkv_bias))
        self.o_proj = Linear(h * hd, d, names=("q_heads", "embed"), dtype=dtype, rngs=rngs, bias=cfg.o_bias)

        def head_norm(with_scale=True):
            return RMSNorm(hd, cfg.rms_norm_eps, dtype=dtype, axis_name="head_dim",
                           offset=cfg.norm_offset, with_scale=with_scale)

        self.q_norm, self.k_norm = (head_norm(), head_norm()) if cfg.qk_norm else (None, None)
        self.v_norm = head_norm(with_scale=False) if cfg.v_norm else None

    def queries(self, x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
        """x [B, T, d] -> rotated queries [B, T, H, D]."""
        q = self.q_proj(x).reshape(*x.shape[:2], self.num_heads, self.head_dim)
        if self.q_norm is not None:
            q = self.q_norm(q)
        return apply_rope(q, cos, sin)

    def keys_values(self, x: jax.Array, cos: jax.Array, sin: jax.Array):
        """x [B, T, d] -> (rotated keys, values), each [B, T, K, D]."""
        k = self.k_proj(x).reshape(*x.shape[:2], self.num_kv_heads, self.head_dim)
        v = k if self.v_proj is None else self.v_proj(x).reshape(k.shape)
        if self.k_norm is not None:
            k = self.k_norm(k)
        if self.v_norm is not None:
            v = self.v_norm(v)
        return apply_rope(k, cos, sin), v

    def output(self, attended: jax.Array) -> jax.Array:
        """[B, T, H, D] -> [B, T, d]."""
        return self.o_proj(attended.reshape(*attended.shape[:2], self.num_heads * self.head_dim))
