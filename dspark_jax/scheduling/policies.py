"""Verification-length policies: how many draft tokens each request verifies.

Every policy maps a batch of per-request draft confidences to integer proposal lengths
``proposal_len`` ``l_r in {0..gamma}`` (the number of draft tokens of request ``r`` that the
target model verifies this round, on top of the always-present anchor token).

Notation (spec section 9, paper Algorithm 1 / Appendix A / Sec. 5.2):

* ``c[r, j]``      per-step confidence of draft position ``j`` of request ``r``
                   (``confidences``, float ``[R, gamma]``, values in ``[0, 1]``).
* ``a[r, j]``      survival ``prod_{i <= j} c[r, i]``: probability that the prefix through
                   ``j`` is accepted (``survivals``).  Non-increasing in ``j``.
* ``B``            forward batch size in tokens: ``sum_r (1 + l_r)`` over active requests
                   (the engine's flat verify runs exactly these tokens).
* ``tau``          expected emitted tokens, ``sum_r (1 + sum_{j <= l_r} a[r, j])``.
* ``SPS(B)``       profiled engine throughput (steps/s) for a forward of ``B`` tokens,
                   given as a table ``sps`` float ``[Bmax + 1]`` indexed by ``B``
                   (``sps[0]`` is never read).
* ``Theta``        expected token throughput ``tau * SPS(B)``.

Conventions shared by all the policies here:

* Everything is pure ``jax.numpy``: jit-able, vmap-able, no host round trips and no Python
  loops over data.  Shapes (``R``, ``gamma``, ``Bmax``) are static; every numeric
  argument (confidences, the SPS table, ``active``, thresholds, capacities, ``g``) may be a
  traced array.
* ``active`` (bool ``[R]``, optional, default all ``True``): inactive rows (padding slots of
  a continuous-batching engine) get length 0, contribute no anchor token to ``B`` and no
  ``1`` to ``tau``, and none of their candidates is admitted.
* Confidences are sanitised to ``[0, 1]`` (NaN -> 0) before the cumulative product, which
  guarantees survivals are non-increasing along a request, hence every admitted set is a
  prefix of its block.
* A candidate with survival exactly 0 is never admitted by the survival-ranked policies
  (Algorithm 1, global search, top-K): it adds nothing to ``tau`` and only costs batch.
* Out-of-table batch sizes: a batch size ``B > Bmax`` (beyond the profiled table) is
  **not admissible** -- its Theta is ``-inf``, so Algorithm 1 stops before it and the
  global search never selects it.  (Equivalently: the engine cannot run such a forward.)
  If the anchors alone already exceed the table (``R_active > Bmax``) every policy based on
  SPS returns zero draft tokens.

Ranking and ties: candidates are ranked by survival, descending; ties are broken by
request index, then position (row-major order of ``[R, gamma]``), so within a request an
earlier position always precedes a later one with the same survival and the admitted set
stays a prefix.
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp

__all__ = [
    "survivals",
    "expected_throughput",
    "throughput_curve",
    "prefix_schedule",
    "global_search_capacity",
    "top_k_prefix_schedule",
    "production_schedule",
    "fixed_proposal_len",
    "full_block_proposal_len",
    "threshold_proposal_len",
]


# ----------------------------------------------------------------------------- helpers


def _active_mask(active: Optional[jax.Array], num_requests: int) -> jax.Array:
    """bool [R]: ``active`` or all-True."""
    if active is None:
        return jnp.ones((num_requests,), dtype=bool)
    return jnp.asarray(active, dtype=bool).reshape((num_requests,))


def _float_dtype(x: jax.Array):
    return x.dtype if jnp.issubdtype(x.dtype, jnp.floating) else jnp.float32


def survivals(confidences: jax.Array) -> jax.Array:
    """Cumulative survival ``a[r, j] = prod_{i <= j} c[r, i]``.

    Args:
      confidences: float ``[R, gamma]`` per-step confidences; clipped to ``[0, 1]``
        (NaN -> 0) so the result is non-increasing along each row.

    Returns:
      float ``[R, gamma]`` survivals.
    """
    c = jnp.asarray(confidences)
    c = c.astype(_float_dtype(c))
    c = jnp.where(jnp.isnan(c), 0.0, jnp.clip(c, 0.0, 1.0))
    return jnp.cumprod(c, axis=-1)


def _sps_lookup(sps: jax.Array, batch: jax.Array) -> tuple[jax.Array, jax.Array]:
    """SPS(batch) and admissibility ``1 <= batch <= Bmax`` (gather clamped, never OOB).

    Args:
      sps: float ``[Bmax + 1]``.
      batch: int array of any shape.

    Returns:
      (float values of ``batch``'s shape, bool ``in_table`` of ``batch``'s shape).
    """
    bmax = sps.shape[0] - 1
    in_table = (batch >= 1) & (batch <= bmax)
    values = sps[jnp.clip(batch, 0, bmax)]
    return values, in_table


def _ranked_candidates(confidences, active):
    """Global ranking of all draft candidates by survival.

    Returns:
      a:       float [R, gamma] survivals.
      valid:   bool  [R, gamma] candidate admissible at all (active row, survival > 0).
      rank:    int32 [R, gamma] position of each candidate in the descending order
               (valid candidates occupy ranks ``0..n_valid-1``).
      a_sorted: float [R * gamma] survivals in ranked order, 0 for invalid ones.
      n_valid: int32 scalar, number of valid candidates.
      r_active: int32 scalar, number of active requests.
      pos_sorted: int32 [R * gamma] block position (0-based) of each candidate in ranked order.
    """
    a = survivals(confidences)
    num_requests, gamma = a.shape
    act = _active_mask(active, num_requests)
    valid = act[:, None] & (a > 0)
    flat_a = jnp.where(valid, a, 0.0).reshape(-1)
    flat_valid = valid.reshape(-1)
    # Sort key: valid candidates by survival descending; invalid ones last.
    key = jnp.where(flat_valid, -flat_a, jnp.inf)
    order = jnp.argsort(key, stable=True)  # stable -> ties in row-major (r, j) order
    rank = jnp.zeros_like(order).at[order].set(jnp.arange(order.shape[0], dtype=order.dtype))
    a_sorted = flat_a[order]
    n_valid = jnp.sum(flat_valid).astype(jnp.int32)
    r_active = jnp.sum(act).astype(jnp.int32)
    pos_sorted = (order % gamma).astype(jnp.int32)
    return (a, valid, rank.reshape(num_requests, gamma).astype(jnp.int32), a_sorted, n_valid,
            r_active, pos_sorted)


def _ranked_curve(confidences, sps, active):
    """(valid [R, gamma], rank [R, gamma], Theta [N + 1]) along the ranked admission path."""
    _, valid, rank, a_sorted, n_valid, r_active, _ = _ranked_candidates(confidences, active)
    tokens = r_active + jnp.arange(a_sorted.shape[0] + 1, dtype=jnp.int32)
    sps = jnp.asarray(sps)
    dtype = jnp.result_type(a_sorted.dtype, _float_dtype(sps))
    k = jnp.arange(a_sorted.shape[0] + 1, dtype=jnp.int32)
    tau = r_active.astype(dtype) + jnp.concatenate(
        [jnp.zeros((1,), dtype), jnp.cumsum(a_sorted.astype(dtype))]
    )
    rate, in_table = _sps_lookup(sps.astype(dtype), tokens)
    ok = in_table & (k <= n_valid)
    return valid, rank, jnp.where(ok, tau * rate, -jnp.inf)


def throughput_curve(
    confidences: jax.Array, sps: jax.Array, active: Optional[jax.Array] = None,
) -> jax.Array:
    """Theta along the greedy admission path: ``Theta[k]`` for ``k = 0..R*gamma`` drafts.

    ``Theta[k] = (R_active + sum of the k largest survivals) * SPS(R_active + k)``: the best
    throughput achievable with exactly ``k`` admitted draft tokens (the top-k survivals maximise ``tau`` and automatically form per-request
    prefixes). Entries with ``k`` beyond the number of positive-survival candidates, or with
    ``B_k > Bmax``, are ``-inf`` (not admissible).

    Args:
      confidences: float ``[R, gamma]``.
      sps: float ``[Bmax + 1]`` steps/s by forward batch size in tokens.
      active: optional bool ``[R]``.

    Returns:
      float ``[R * gamma + 1]``.
    """
    return _ranked_curve(confidences, sps, active)[2]


def expected_throughput(
    confidences: jax.Array,
    proposal_len: jax.Array,
    sps: jax.Array,
    active: Optional[jax.Array] = None,
) -> jax.Array:
    """Theta = tau * SPS(B) of an arbitrary length assignment.

    Args:
      confidences: float ``[R, gamma]``.
      proposal_len: int ``[R]`` in ``0..gamma`` (inactive rows are ignored).
      sps: float ``[Bmax + 1]``.
      active: optional bool ``[R]``.

    Returns:
      float scalar; ``-inf`` when ``B`` is outside the table.
    """
    a = survivals(confidences)
    num_requests, gamma = a.shape
    act = _active_mask(active, num_requests)
    proposal_len = jnp.where(act, jnp.clip(jnp.asarray(proposal_len, jnp.int32), 0, gamma), 0)
    take = jnp.arange(gamma)[None, :] < proposal_len[:, None]
    tau = jnp.sum(act) + jnp.sum(jnp.where(take, a, 0.0))
    batch = jnp.sum(act).astype(jnp.int32) + jnp.sum(proposal_len)
    rate, in_table = _sps_lookup(jnp.asarray(sps), batch)
    return jnp.where(in_table, tau * rate, -jnp.inf)


def _lengths_from_count(valid, rank, count):
    """int32 [R]: per-request number of candidates with rank < count (a prefix per row)."""
    admitted = valid & (rank < count)
    return jnp.sum(admitted, axis=-1).astype(jnp.int32)


# ----------------------------------------------------------------------------- policies


def prefix_schedule(
    confidences: jax.Array, sps: jax.Array, active: Optional[jax.Array] = None,
) -> jax.Array:
    """Hardware-aware prefix scheduler with early stopping (paper Algorithm 1).

    Sort all survivals ``a[r, j]`` of active requests descending; start at
    ``B = tau = R_active`` and ``Theta_best = R_active * SPS(R_active)``; admit candidates
    one at a time (``B += 1``, ``tau += a``) and stop at the first admission whose Theta
    does not strictly exceed ``Theta_best`` (or whose ``B`` is beyond the SPS table, or
    whose survival is 0).  The early stop makes the decision for position ``k + 1`` depend
    only on positions already processed, which is what keeps it lossless when ``c[k+1]``
    depends on the sampled ``x_k`` (Appendix A).  It reaches the global optimum of Theta
    over all length vectors iff Theta is unimodal along the admission path.

    Args:
      confidences: float ``[R, gamma]`` per-step confidences ``c``.
      sps: float ``[Bmax + 1]`` steps/s by forward batch size in tokens.
      active: optional bool ``[R]``.

    Returns:
      int32 ``[R]`` proposal lengths (a prefix of each block; 0 for inactive rows).
    """
    valid, rank, theta = _ranked_curve(confidences, sps, active)  # Theta [N + 1]
    improves = theta[1:] > theta[:-1]  # along the path Theta_best == Theta[k-1]
    count = jnp.sum(jnp.cumprod(improves.astype(jnp.int32))).astype(jnp.int32)
    return _lengths_from_count(valid, rank, count)


def global_search_capacity(
    confidences: jax.Array, sps: jax.Array, active: Optional[jax.Array] = None,
) -> jax.Array:
    """Unconstrained global search of the production scheduler (paper Sec. 5.2).

    ``K = argmax_k Theta(k)`` over ``k = 0..R*gamma`` with
    ``Theta(k) = (R_active + sum of the top-k survivals) * SPS(R_active + k)``; no early
    stop, so it crosses the cliffs of a step-shaped SPS curve.  Ties go to the smallest
    ``k``.  Inadmissible ``k`` (beyond the table, or beyond the positive-survival
    candidates) are never chosen.  Only causal when fed confidences that do not depend
    on the tokens being verified (the production variant uses those of two steps earlier).

    Args:
      confidences: float ``[R, gamma]``.
      sps: float ``[Bmax + 1]``.
      active: optional bool ``[R]``.

    Returns:
      int32 scalar capacity ``K``.
    """
    theta = throughput_curve(confidences, sps, active)
    return jnp.argmax(theta).astype(jnp.int32)


def top_k_prefix_schedule(
    confidences: jax.Array, capacity: jax.Array, active: Optional[jax.Array] = None
) -> jax.Array:
    """Admit the ``capacity`` candidates with the largest current survival.

    Rank-preserving dynamic top-K selection: candidates of active requests are ranked by
    survival (ties: request, then position), the first ``min(capacity, #positive)`` are
    admitted.  Since survivals are non-increasing along a block the admitted set is a
    prefix per request.

    Args:
      confidences: float ``[R, gamma]``.
      capacity: int scalar ``K`` (clamped at 0 below).
      active: optional bool ``[R]``.

    Returns:
      int32 ``[R]`` proposal lengths with ``sum(proposal_len) == min(K, #positive candidates)``.
    """
    _, valid, rank, _, _, _, _ = _ranked_candidates(confidences, active)
    count = jnp.maximum(jnp.asarray(capacity, jnp.int32), 0)
    return _lengths_from_count(valid, rank, count)


def production_schedule(
    current_confidences: jax.Array,
    lagged_confidences: jax.Array,
    sps: jax.Array,
    active: Optional[jax.Array] = None,
    lagged_active: Optional[jax.Array] = None,
) -> jax.Array:
    """Asynchronous production scheduler (paper Sec. 5.2).

    The capacity ``K`` comes from the unconstrained global search over the confidences of
    TWO STEPS EARLIER (the engine keeps a short history), so it does not depend on the
    tokens being verified now; this step's candidates are then ranked by their current
    survival and the top ``K`` admitted.

    Args:
      current_confidences: float ``[R, gamma]`` confidences of this step's drafts.
      lagged_confidences: float ``[R, gamma]`` confidences produced two steps earlier.
      sps: float ``[Bmax + 1]``.
      active: optional bool ``[R]`` requests active this step.
      lagged_active: optional bool ``[R]`` requests active in the lagged step
        (defaults to ``active``).

    Returns:
      int32 ``[R]`` proposal_len.
    """
    if lagged_active is None:
        lagged_active = active
    capacity = global_search_capacity(lagged_confidences, sps, lagged_active)
    return top_k_prefix_schedule(current_confidences, capacity, active)


# ----------------------------------------------------------------------------- baselines


def fixed_proposal_len(
    num_requests: int, gamma: int, g, active: Optional[jax.Array] = None
) -> jax.Array:
    """Fixed verification length ``g`` for every request (``g = 1``: MTP-1 analogue).

    Args:
      num_requests: static ``R``.
      gamma: static block size.
      g: int scalar (may be traced), clipped to ``0..gamma``.
      active: optional bool ``[R]``; inactive rows get 0.

    Returns:
      int32 ``[R]``.
    """
    g = jnp.clip(jnp.asarray(g, jnp.int32), 0, gamma)
    act = _active_mask(active, num_requests)
    return jnp.where(act, g, 0).astype(jnp.int32)


def full_block_proposal_len(
    num_requests: int, gamma: int, active: Optional[jax.Array] = None
) -> jax.Array:
    """Full block: every active request verifies all ``gamma`` drafts. int32 ``[R]``."""
    return fixed_proposal_len(num_requests, gamma, gamma, active)


def threshold_proposal_len(
    confidences: jax.Array, threshold, active: Optional[jax.Array] = None
) -> jax.Array:
    """Static truncation (reference ``draft_ops._confident_prefix_length``).

    ``threshold <= 0`` keeps the whole block; otherwise keep the prefix before the first
    position ``k`` with ``c[k] < threshold`` (per-step confidence, not the cumulative
    survival).

    Args:
      confidences: float ``[R, gamma]`` per-step confidences (already sigmoided).
      threshold: float scalar (may be traced).
      active: optional bool ``[R]``; inactive rows get 0.

    Returns:
      int32 ``[R]``.
    """
    c = jnp.asarray(confidences)
    num_requests, gamma = c.shape
    threshold = jnp.asarray(threshold, _float_dtype(c))
    passes = ~(c < threshold)  # NaN confidences pass, as in a Python `c < t` check
    prefix = jnp.sum(jnp.cumprod(passes.astype(jnp.int32), axis=-1), axis=-1)
    proposal_len = jnp.where(threshold <= 0, gamma, prefix)
    act = _active_mask(active, num_requests)
    return jnp.where(act, proposal_len, 0).astype(jnp.int32)
