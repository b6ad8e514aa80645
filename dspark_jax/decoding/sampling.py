"""Temperature, top-k and top-p as traced arrays, and the exact probability rows they give.

Every sampler in the project (the autoregressive loop, the drafter's block sampler, the
rejection sampler's target rows) goes through :func:`sampling_probs`, so that the draft
probabilities ``q`` and target probabilities ``p`` are produced by exactly the same processing
as the tokens that were sampled from them.

Sampling parameters are arrays broadcastable to the leading dimensions of the logits: changing
them between calls never recompiles. A PRNG key is one key for the whole batch or a key per row
(a key array [b]): then row i draws only from key i, so a request's random stream does not
depend on which other requests share its batch (:func:`split_key`, :func:`fold_key`,
:func:`uniform`). ``temperature <= GREEDY_TEMPERATURE`` is greedy decoding,
whose probability row is the point mass on the argmax (ties go to the lowest id).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

GREEDY_TEMPERATURE = 1e-5


@struct.dataclass
class SamplingParams:
    """Per-row sampling settings, each [B] (traced: changing them never recompiles)."""

    temperature: jax.Array
    top_p: jax.Array
    top_k: jax.Array

    @classmethod
    def broadcast(cls, batch: int, temperature=0.0, top_p=1.0, top_k=0) -> "SamplingParams":
        return cls(jnp.broadcast_to(jnp.asarray(temperature, jnp.float32), (batch,)),
                   jnp.broadcast_to(jnp.asarray(top_p, jnp.float32), (batch,)),
                   jnp.broadcast_to(jnp.asarray(top_k, jnp.int32), (batch,)))


def is_eos(tokens: jax.Array, eos_ids: jax.Array) -> jax.Array:
    """tokens int [...], eos_ids int [E] -> bool [...]."""
    return jnp.any(tokens[..., None] == eos_ids, axis=-1)


def _expand(x: jax.Array | float, ndim: int, dtype=jnp.float32) -> jax.Array:
    """Casts a per-row parameter of shape [...] to [..., 1] for broadcasting over the vocabulary."""
    x = jnp.asarray(x, dtype)
    return x.reshape(x.shape + (1,) * (ndim - x.ndim))


def argmax(x: jax.Array) -> jax.Array:
    """``jnp.argmax(x, axis=-1)`` as int32 (ties to the lowest index) for finite rows.

    Two plain reductions (the maximum, then the first index holding it) vectorise on CPU,
    where XLA's (value, index) argmax reduction runs about 3x slower over a vocabulary."""
    top = jnp.max(x, axis=-1, keepdims=True)
    index = jax.lax.broadcasted_iota(jnp.int32, x.shape, x.ndim - 1)
    return jnp.min(jnp.where(x == top, index, x.shape[-1]), axis=-1)


def sampling_probs(
    logits: jax.Array,
    temperature: jax.Array | float = 1.0,
    top_p: jax.Array | float = 1.0,
    top_k: jax.Array | int = 0,
) -> jax.Array:
    """Probability rows after temperature, top-k and top-p processing.

    Args:
      logits: [..., V] raw logits (any float dtype; computed in float32).
      temperature: broadcastable to [...]; <= GREEDY_TEMPERATURE means greedy (point mass).
      top_p: broadcastable to [...]; nucleus mass in (0, 1]; 1 disables it. Tokens tied with the
        smallest kept probability are kept too, so the row does not depend on sort order.
      top_k: broadcastable to [...]; keep the k most likely tokens (ties kept); <= 0 disables it.

    Returns:
      [..., V] float32 rows that sum to 1.
    """
    logits = logits.astype(jnp.float32)
    ndim = logits.ndim
    t = _expand(temperature, ndim)
    greedy = t <= GREEDY_TEMPERATURE
    point_mass = jax.nn.one_hot(argmax(logits), logits.shape[-1], dtype=jnp.float32)

    def processed():
        probs = jax.nn.softmax(logits / jnp.where(greedy, 1.0, t), axis=-1)
        probs = jax.lax.cond(
            jnp.any(_expand(top_p, ndim) < 1.0) | jnp.any(_expand(top_k, ndim, jnp.int32) > 0),
            lambda pr: _truncate(pr, top_p, top_k), lambda pr: pr, probs)
        return jnp.where(greedy, point_mass, probs)

    # An all-greedy batch skips the softmax (and truncation) it would throw away.
    return jax.lax.cond(jnp.all(greedy), lambda: point_mass, processed)


TRUNCATION_CANDIDATES = 64  # the static top-k of the exact fast truncation path


def _truncate(probs: jax.Array, top_p, top_k) -> jax.Array:
    """Top-k then top-p truncation of probability rows [..., V], renormalised.

    A token is kept when its probability reaches the cutoff of each active rule. As in
    transformers and vLLM, the nucleus is taken on the top-k renormalised row: the shortest
    prefix of the descending row whose mass reaches top_p (the exclusive cumsum < top_p marks
    every member); ties with the smallest kept probability are kept too.

    Both cutoffs depend only on the ``TRUNCATION_CANDIDATES`` largest probabilities whenever
    every row has ``top_k`` in 1..TRUNCATION_CANDIDATES, or no top-k and a nucleus inside them,
    or no truncation at all. Such batches (the reference's top-k 20, for one) take the cutoffs
    from ``lax.top_k`` instead of sorting the whole vocabulary; others sort. Same rows either
    way: see tests/decoding/test_truncation.py.
    """
    ndim, vocab = probs.ndim, probs.shape[-1]
    k = _expand(top_k, ndim, jnp.int32)
    k = jnp.where(k <= 0, vocab, jnp.minimum(k, vocab))
    p = _expand(top_p, ndim)
    num = min(TRUNCATION_CANDIDATES, vocab)
    # [..., num] descending. The barrier keeps XLA:CPU's top-k kernel: when the branch predicate
    # below is fused with the top-k, the compiler lowers it to a full sort instead.
    candidates = jax.lax.optimization_barrier(jax.lax.top_k(probs, num)[0])
    # Rows without top-k keep every token of probability >= 0; their kth is 0.
    kth = jnp.where(k <= num, jnp.take_along_axis(candidates, jnp.minimum(k, num) - 1, axis=-1), 0.0)
    # The nucleus ends before the last candidate (a margin of one token against rounding).
    nucleus_inside = (jnp.sum(candidates[..., :-1], axis=-1, keepdims=True)
                      >= p * jnp.sum(probs, axis=-1, keepdims=True))
    exact = (k <= num) | ((k == vocab) & ((p >= 1.0) | nucleus_inside))

    def cutoff(sorted_probs, kth):
        """The cutoff probability [..., 1] from a descending prefix of each row (at least the
        top-k tokens and the nucleus) and its kth largest probability [..., 1]."""
        mass = jnp.sum(jnp.where(probs >= kth, probs, 0.0), axis=-1, keepdims=True)  # top-k mass
        in_top_k = jnp.where(sorted_probs >= kth, sorted_probs, 0.0) / mass
        exclusive = jnp.cumsum(in_top_k, axis=-1) - in_top_k
        n_keep = jnp.maximum(jnp.sum(exclusive < p, axis=-1, keepdims=True), 1)
        nucleus_min = jnp.take_along_axis(sorted_probs, n_keep - 1, axis=-1)
        return jnp.maximum(kth, jnp.where(p >= 1.0, 0.0, nucleus_min))

    def from_sort():
        sorted_probs = -jnp.sort(-probs, axis=-1)
        return cutoff(sorted_probs, jnp.take_along_axis(sorted_probs, k - 1, axis=-1))

    cut = jax.lax.cond(jnp.all(exact), lambda: cutoff(candidates, kth), from_sort)
    probs = jnp.where(probs >= cut, probs, 0.0)
    return probs / jnp.sum(probs, axis=-1, keepdims=True)


SAMPLE_BLOCK = 256  # vocabulary block of the two-level inverse-CDF draw


def _first_above(cdf: jax.Array, u: jax.Array, mass: jax.Array) -> jax.Array:
    """The first index whose ``cdf`` [..., n] exceeds ``u`` [...], clamped to the last index of
    positive ``mass`` [..., n] (a rounding guard). Indices of zero mass are never returned."""
    index = jnp.sum(cdf <= u[..., None], axis=-1, dtype=jnp.int32)
    iota = jax.lax.broadcasted_iota(jnp.int32, mass.shape, mass.ndim - 1)
    last = jnp.max(jnp.where(mass > 0, iota, 0), axis=-1)
    return jnp.minimum(index, last)


def inverse_cdf(probs: jax.Array, u_block: jax.Array, u_token: jax.Array,
                block: int = SAMPLE_BLOCK) -> jax.Array:
    """The token that uniforms ``u_block``, ``u_token`` [...] in [0, 1) pick from ``probs`` [..., V].

    Two levels: ``u_block`` picks a block of ``block`` consecutive tokens by its mass, then
    ``u_token`` a token inside it by its mass within the block, so P(token) = P(block) *
    P(token | block) = probs[token] (up to float rounding). Tokens of zero probability are never
    picked. Returns int32 [...].
    """
    *lead, vocab = probs.shape
    num_blocks = -(-vocab // block)
    padded = jnp.pad(probs, [(0, 0)] * len(lead) + [(0, num_blocks * block - vocab)])
    blocks = padded.reshape(*lead, num_blocks, block)
    block_mass = jnp.sum(blocks, axis=-1)  # [..., num_blocks]
    block_cdf = jnp.cumsum(block_mass, axis=-1)
    b = _first_above(block_cdf, u_block * block_cdf[..., -1], block_mass)
    inner = jnp.take_along_axis(blocks, b[..., None, None], axis=-2)[..., 0, :]  # [..., block]
    inner_cdf = jnp.cumsum(inner, axis=-1)
    return b * block + _first_above(inner_cdf, u_token * inner_cdf[..., -1], inner)


def split_key(key: jax.Array, num: int = 2) -> list[jax.Array]:
    """``num`` new keys from one key, or from a key per row ([b] -> ``num`` key arrays [b])."""
    if key.ndim == 0:
        return list(jax.random.split(key, num))
    keys = jax.vmap(lambda k: jax.random.split(k, num))(key)  # [b, num]
    return [keys[:, i] for i in range(num)]


def fold_key(key: jax.Array, data) -> jax.Array:
    """``jax.random.fold_in`` of one key, or of each key of a key per row."""
    if key.ndim == 0:
        return jax.random.fold_in(key, data)
    return jax.vmap(lambda k: jax.random.fold_in(k, data))(key)


def uniform(key: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    """float32 uniforms in [0, 1) of ``shape``; with a key per row [shape[0]], row i draws
    from key i alone."""
    if key.ndim == 0:
        return jax.random.uniform(key, shape, jnp.float32)
    return jax.vmap(lambda k: jax.random.uniform(k, shape[1:], jnp.float32))(key)


def sample_from_probs(key: jax.Array, probs: jax.Array) -> jax.Array:
    """Draws one token per row of ``probs`` [..., V] from that law; returns int32 [...].

    Inverse-CDF sampling with two uniforms per row (:func:`inverse_cdf`). It reads the row
    about once; the Gumbel-max draw (``jax.random.categorical``) needs V random numbers and V
    logarithms per row: 30-100x slower on CPU for a 49k vocabulary
    (``benchmarks/bench_sampling.py``).
    """
    k_block, k_token = split_key(key)
    lead = probs.shape[:-1]
    return inverse_cdf(probs, uniform(k_block, lead), uniform(k_token, lead))


def sample(
    key: jax.Array,
    logits: jax.Array,
    temperature: jax.Array | float = 1.0,
    top_p: jax.Array | float = 1.0,
    top_k: jax.Array | int = 0,
) -> tuple[jax.Array, jax.Array]:
    """Samples tokens from processed logits.

    Returns:
      tokens: int32 [...].
      probs: float32 [..., V], the exact row each token was drawn from.
    """
    probs = sampling_probs(logits, temperature, top_p, top_k)
    greedy = jnp.all(jnp.asarray(temperature) <= GREEDY_TEMPERATURE)
    tokens = jax.lax.cond(greedy, lambda: argmax(logits),
                          lambda: sample_from_probs(key, probs))
    return tokens, probs
