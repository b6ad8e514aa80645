"""Top-k / top-p truncation: the fast path over the largest candidates and the full sort give
the rows of a float64 reference, and the supports of transformers' logits warpers."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dspark_jax.decoding.sampling import TRUNCATION_CANDIDATES, sampling_probs

VOCAB = 4 * TRUNCATION_CANDIDATES + 11
ROWS = 6  # every call warps [ROWS, VOCAB] with per-row settings: one compile

warp = jax.jit(lambda logits, top_p, top_k: sampling_probs(logits, 1.0, top_p, top_k))


def reference(probs: np.ndarray, top_p: float, top_k: int) -> np.ndarray:
    """The documented rule in float64 over a full sort: keep probs >= the cutoff of each rule,
    the nucleus taken on the top-k renormalised row, ties with the last kept token kept."""
    probs = probs.astype(np.float64)
    desc = -np.sort(-probs)
    k = len(probs) if top_k <= 0 else min(top_k, len(probs))
    kth = desc[k - 1]
    in_top_k = np.where(desc >= kth, desc, 0.0)
    in_top_k /= in_top_k.sum()
    exclusive = np.cumsum(in_top_k) - in_top_k
    n_keep = max(int(np.sum(exclusive < top_p)), 1)
    cutoff = max(kth, 0.0 if top_p >= 1.0 else desc[n_keep - 1])
    kept = np.where(probs >= cutoff, probs, 0.0)
    return kept / kept.sum()


def _rows(seed: int, n: int, scale: float) -> np.ndarray:
    logits = np.random.default_rng(seed).normal(size=(n, VOCAB)) * scale
    e = np.exp(logits - logits.max(-1, keepdims=True))
    return (e / e.sum(-1, keepdims=True)).astype(np.float32)


def _with_ties(probs: np.ndarray, rank: int, count: int) -> np.ndarray:
    """Gives the tokens ranked rank..rank+count-1 of each row one shared probability."""
    probs = probs.copy()
    for row in probs:
        order = np.argsort(-row)
        row[order[rank:rank + count]] = row[order[rank]]
    return probs / probs.sum(-1, keepdims=True)


def _check(probs, top_p, top_k):
    top_p = np.broadcast_to(np.float32(top_p), (ROWS,))
    top_k = np.broadcast_to(np.int32(top_k), (ROWS,))
    got = np.asarray(warp(jnp.log(jnp.asarray(probs)), top_p, top_k))
    for row, p, k, g in zip(probs, top_p, top_k, got):
        # The warped rows are renormalised softmax rows of log(probs): the same law up to float32.
        want = reference(row / row.sum(), float(p), int(k))
        np.testing.assert_array_equal(g > 0, want > 0)
        np.testing.assert_allclose(g, want, atol=2e-6, rtol=1e-4)


@pytest.mark.parametrize("top_k", [1, 7, 20, TRUNCATION_CANDIDATES])
@pytest.mark.parametrize("top_p", [1.0, 0.8, 0.3])
def test_top_k_within_the_candidates(top_k, top_p):
    _check(_rows(0, ROWS, scale=2.0), top_p, top_k)


@pytest.mark.parametrize("top_k", [TRUNCATION_CANDIDATES + 1, 3 * TRUNCATION_CANDIDATES, 0])
@pytest.mark.parametrize("top_p", [1.0, 0.95, 0.5])
def test_top_k_beyond_the_candidates_and_wide_nuclei(top_k, top_p):
    # scale 0.3: nearly flat rows, so a 0.95 nucleus holds far more than the candidates.
    _check(_rows(1, ROWS, scale=0.3), top_p, top_k)
    _check(_rows(2, ROWS, scale=4.0), top_p, top_k)


def test_ties_at_the_kth_token_reaching_past_the_candidates():
    probs = _with_ties(_rows(3, ROWS, scale=3.0), rank=5, count=2 * TRUNCATION_CANDIDATES)
    for top_p in (1.0, 0.9, 0.999):
        _check(probs, top_p, 10)


def test_mixed_rows_of_one_batch():
    """Rows that the candidates decide next to rows that need the sort, in one call."""
    probs = np.concatenate([_rows(4, 3, scale=2.0), _rows(5, 3, scale=0.3)])
    _check(probs, np.array([0.8, 1.0, 0.5, 0.95, 0.99, 1.0], np.float32),
           np.array([20, 0, 0, 0, 200, 5], np.int32))


@pytest.mark.parametrize("top_k,top_p", [(20, 0.8), (0, 0.9), (50, 1.0), (100, 0.7)])
def test_supports_match_transformers_warpers(top_k, top_p):
    torch = pytest.importorskip("torch")
    from transformers.generation.logits_process import TopKLogitsWarper, TopPLogitsWarper

    logits = np.random.default_rng(6).normal(size=(ROWS, VOCAB)).astype(np.float32) * 2
    scores = torch.tensor(logits)
    if top_k > 0:
        scores = TopKLogitsWarper(top_k)(None, scores)
    if top_p < 1.0:
        scores = TopPLogitsWarper(top_p)(None, scores)
    theirs = torch.isfinite(scores).numpy()
    ours = np.asarray(warp(jnp.asarray(logits), np.full(ROWS, top_p, np.float32),
                           np.full(ROWS, top_k, np.int32))) > 0
    np.testing.assert_array_equal(ours, theirs)
