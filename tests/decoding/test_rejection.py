"""Tests of the speculative-decoding rejection sampler (spec section 7, step 5).

The exact-law tests drive the implementation itself with controlled randomness: every draft
sequence is enumerated (weight prod q), every accept/reject pattern is realised by uniforms placed
exactly at the implementation's acceptance thresholds (weight prod a * (1 - a)), and the law of the
emitted token is the ``next_probs`` row the implementation returns. The resulting law of the
emitted sequence, completed with target sampling, must equal the target law.
"""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dspark_jax.decoding.rejection import (
    RESIDUAL_EPS,
    VerifyResult,
    acceptance_probs,
    greedy_verify,
    rejection_sample,
    verify_from_uniforms,
    verify_logits,
)
from dspark_jax.decoding.sampling import argmax, sample_from_probs, sampling_probs

_verify = jax.jit(verify_from_uniforms)
_acceptance = jax.jit(acceptance_probs)

# chi-square 99.9% quantiles by degrees of freedom (no scipy).
_CHI2_999 = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52, 6: 22.46, 7: 24.32}


def _chi2(counts: np.ndarray, probs: np.ndarray) -> tuple[float, int]:
    """Pearson statistic of ``counts`` against ``probs``; mass outside the support counts as inf."""
    n = counts.sum()
    support = probs > 0
    if counts[~support].sum() > 0:
        return float("inf"), int(support.sum()) - 1
    expected = n * probs[support]
    stat = float(((counts[support] - expected) ** 2 / expected).sum())
    return stat, int(support.sum()) - 1


# --------------------------------------------------------------------------------------------
# 1. Exact law of the emitted sequence.

V_LAW, K_LAW, ANCHOR = 5, 3, 0


def _law_tables(seed, markov, temp_p, temp_q, top_p, top_k):
    """Target rows P [K+1, V_prev, V] and draft rows Q [K, V_prev, V] (float32 numpy).

    Row P[k, prev] is the target law of position k given the previous token (the anchor for
    k = 0); with ``markov=False`` it does not depend on ``prev``. Q likewise for the drafter.
    """
    rng = np.random.default_rng(seed)

    def make(n_pos, temp):
        shape = (n_pos, V_LAW if markov else 1, V_LAW)
        logits = np.broadcast_to(rng.normal(size=shape) * 1.5, (n_pos, V_LAW, V_LAW))
        return np.asarray(sampling_probs(jnp.asarray(logits, jnp.float32), temp, top_p, top_k))

    return make(K_LAW + 1, temp_p), make(K_LAW, temp_q)


def _draft_batch(P, Q):
    """One row per (proposal_len n, draft sequence x of positive probability).

    Padding positions k >= n draft the target argmax t from the row 0.5 p + 0.5 delta_{t+1}, so
    their acceptance probability is 1 (they would be accepted if they were not masked) while the
    residual max(p - q, 0) is not p (a bonus drawn from it instead of p would show).
    """
    K, V = Q.shape[0], Q.shape[-1]
    meta, toks, dps, tps = [], [], [], []
    for n in range(K + 1):
        for x in itertools.product(range(V), repeat=n):
            prev = (ANCHOR,) + x
            w = float(np.prod([np.float64(Q[k, prev[k], x[k]]) for k in range(n)]))
            if w == 0.0:
                continue
            tok = np.zeros(K, np.int32)
            dp = np.zeros((K, V), np.float32)
            tp = np.zeros((K + 1, V), np.float32)
            for k in range(n + 1):
                tp[k] = P[k, prev[k]]
            for k in range(n):
                dp[k], tok[k] = Q[k, prev[k]], x[k]
            for k in range(n, K):
                tok[k] = np.argmax(tp[k])
                dp[k] = 0.5 * tp[k] + 0.5 * np.eye(V, dtype=np.float32)[(tok[k] + 1) % V]
                tp[k + 1] = P[k + 1, tok[k]]
            meta.append((n, x, w))
            toks.append(tok)
            dps.append(dp)
            tps.append(tp)
    return meta, np.stack(toks), np.stack(dps), np.stack(tps)


def _pad_rows(arrays, multiple=256):
    """Pads the batch to a multiple of ``multiple`` by repeating row 0 (limits recompiles)."""
    b = arrays[0].shape[0]
    pad = -b % multiple
    return [np.concatenate([a, np.repeat(a[:1], pad, axis=0)]) for a in arrays]


def _emitted_law(P, Q, verify=_verify):
    """Runs the implementation on every (draft sequence, accept pattern) and returns, per n, the
    law of the emitted sequence completed to n + 1 tokens with target sampling, and the target law.
    """
    K, V = Q.shape[0], Q.shape[-1]
    meta, toks, dps, tps = _draft_batch(P, Q)
    ndraft = np.array([m[0] for m in meta], np.int32)

    a = np.asarray(_acceptance(*[jnp.asarray(v) for v in _pad_rows([toks, dps, tps])]))
    a = a[: len(meta)]
    # Independent check of the helper (float64), and that padding would be accepted.
    p_x = np.take_along_axis(tps[:, :K].astype(np.float64), toks[..., None], -1)[..., 0]
    q_x = np.take_along_axis(dps.astype(np.float64), toks[..., None], -1)[..., 0]
    np.testing.assert_allclose(a, np.minimum(1.0, p_x / q_x), rtol=1e-6, atol=0)
    pad = np.arange(K)[None] >= ndraft[:, None]
    assert np.all(a[pad] == 1.0)

    # Expand every accept pattern j of positive probability, with uniforms on the thresholds:
    # just below a_i for i < j (accepted), exactly a_j at j (rejected), 0 after j and in padding.
    rows, weights, js, us = [], [], [], []
    for r, (n, x, w) in enumerate(meta):
        for j in range(n + 1):
            wj = w * np.prod(a[r, :j].astype(np.float64))
            if j < n:
                wj *= 1.0 - np.float64(a[r, j])
            if wj == 0.0:
                continue
            u = np.zeros(K, np.float32)
            u[:j] = np.nextafter(a[r, :j], np.float32(0))
            if j < n:
                u[j] = a[r, j]
            rows.append(r)
            weights.append(wj)
            js.append(j)
            us.append(u)
    rows, js = np.array(rows), np.array(js)
    batch = _pad_rows([np.stack(us), toks[rows], dps[rows], tps[rows], ndraft[rows]])
    out = verify(*[jnp.asarray(v) for v in batch])
    num_acc = np.asarray(out.num_accepted)[: len(rows)]
    mask = np.asarray(out.accepted_mask)[: len(rows)]
    next_probs = np.asarray(out.next_probs, np.float64)[: len(rows)]
    np.testing.assert_array_equal(num_acc, js)
    np.testing.assert_array_equal(mask, np.arange(K)[None] < js[:, None])

    P64 = P.astype(np.float64)
    laws, targets = {}, {}
    for n in range(K + 1):
        # emitted[L]: law of emitted sequences of length L (j = L - 1 accepted drafts + 1 token).
        emitted = {L: np.zeros((V,) * L) for L in range(1, n + 2)}
        for i in np.flatnonzero(ndraft[rows] == n):
            prefix = meta[rows[i]][1][: js[i]]
            emitted[js[i] + 1][prefix] += weights[i] * next_probs[i]
        law = np.zeros((V,) * (n + 1))
        for L, e in emitted.items():
            for m in range(L, n + 1):  # complete with target sampling
                e = e[..., :, None] * P64[m]
            law += e
        target = P64[0, ANCHOR]
        for m in range(1, n + 1):
            target = target[..., :, None] * P64[m]
        laws[n], targets[n] = law, target
    return laws, targets


LAW_CASES = [
    # markov, temp_p, temp_q, top_p, top_k
    (False, 1.0, 1.0, 1.0, 0),
    (True, 1.0, 1.0, 1.0, 0),
    (True, 0.7, 0.7, 0.8, 0),
    (True, 1.0, 1.0, 1.0, 3),
    (False, 1.3, 1.3, 0.8, 3),
    (True, 0.0, 0.0, 1.0, 0),  # greedy: point masses
    (True, 1.0, 0.0, 1.0, 0),  # greedy draft, sampled target
    (True, 0.0, 1.0, 0.9, 0),  # greedy target, sampled draft
]


@pytest.mark.parametrize("case", range(len(LAW_CASES)))
def test_emitted_sequence_has_target_law(case):
    P, Q = _law_tables(100 + case, *LAW_CASES[case])
    laws, targets = _emitted_law(P, Q)
    for n in range(K_LAW + 1):
        tv = 0.5 * np.abs(laws[n] - targets[n]).sum()
        assert tv <= 1e-6, (n, tv)
        # Position by position: law of token m given the emitted prefix equals the target row.
        for m in range(n + 1):
            marg = laws[n].sum(axis=tuple(range(m + 1, n + 1)))
            tmarg = targets[n].sum(axis=tuple(range(m + 1, n + 1)))
            assert 0.5 * np.abs(marg - tmarg).sum() <= 1e-6


def test_law_check_detects_wrong_correction_row():
    """The same harness with a deliberately wrong verifier (plain p instead of the residual)
    must report a large TV distance: the exact-law test has teeth."""
    def broken(u, t, q, p, n):
        out = verify_from_uniforms(u, t, q, p, n)
        p_j = jnp.take_along_axis(p, out.num_accepted[:, None, None], axis=1)[:, 0]
        return out._replace(next_probs=p_j)

    P, Q = _law_tables(101, *LAW_CASES[1])
    laws, targets = _emitted_law(P, Q, verify=jax.jit(broken))
    assert 0.5 * np.abs(laws[K_LAW] - targets[K_LAW]).sum() > 1e-2


def test_residual_fallback_and_normalization():
    """Below RESIDUAL_EPS of residual mass the correction row is p itself; above, the normalized
    residual."""
    q = np.array([0.1, 0.05, 0.35, 0.5], np.float32)
    p_tiny = q.copy()
    p_tiny[0] = np.nextafter(q[0], np.float32(0))  # p(x) < q(x): rejection possible
    p_tiny[1] = np.nextafter(q[1], np.float32(1))  # residual mass ~3.7e-9 < 1e-8
    p_big = np.array([0.05, 0.3, 0.35, 0.3], np.float32)
    tokens = np.zeros((2, 1), np.int32)
    dp = np.stack([q, q])[:, None]
    tp = np.stack([np.stack([p_tiny, q]), np.stack([p_big, q])])
    a = np.asarray(_acceptance(tokens, dp, tp))
    assert a[0, 0] < 1.0
    res = np.maximum(p_tiny.astype(np.float64) - q, 0).sum()
    assert 0 < res < RESIDUAL_EPS
    out = _verify(a, tokens, dp, tp, np.ones(2, np.int32))
    np.testing.assert_array_equal(np.asarray(out.num_accepted), [0, 0])
    np.testing.assert_allclose(np.asarray(out.next_probs[0]), p_tiny, rtol=1e-6)
    residual = np.maximum(p_big - q, 0)
    np.testing.assert_allclose(np.asarray(out.next_probs[1]), residual / residual.sum(), rtol=1e-6)


# --------------------------------------------------------------------------------------------
# 2. Greedy: point masses through the same code.


def test_greedy_accepts_matching_prefix():
    V, K, B = 7, 4, 10
    rng = np.random.default_rng(0)
    target_tok = rng.integers(0, V, size=(B, K + 1))
    match = np.array([0, 1, 2, 3, 4, 0, 2, 4, 3, 1])  # length of the matching draft prefix
    proposal_len = np.array([4, 4, 4, 4, 4, 0, 1, 3, 2, 4], np.int32)
    draft_tok = rng.integers(0, V, size=(B, K))
    for b in range(B):
        draft_tok[b, : match[b]] = target_tok[b, : match[b]]
        if match[b] < K:
            draft_tok[b, match[b]] = (target_tok[b, match[b]] + 1 + rng.integers(0, V - 1)) % V
    one_hot = lambda t: np.eye(V)[t] * 8.0  # noqa: E731
    target_logits = jnp.asarray(rng.normal(size=(B, K + 1, V)) + one_hot(target_tok), jnp.float32)
    p = sampling_probs(target_logits, 0.0)
    q = sampling_probs(jnp.asarray(rng.normal(size=(B, K, V)) + one_hot(draft_tok)), 0.0)
    np.testing.assert_array_equal(np.asarray(jnp.argmax(q, -1)), draft_tok)

    expected_acc = np.minimum(match, proposal_len)
    expected_next = target_tok[np.arange(B), expected_acc]
    keys = jax.random.split(jax.random.key(1), 8)
    run = jax.jit(jax.vmap(rejection_sample, in_axes=(0, None, None, None, None)))
    out = run(keys, jnp.asarray(draft_tok, jnp.int32), q, p, jnp.asarray(proposal_len))
    for s in range(len(keys)):
        np.testing.assert_array_equal(np.asarray(out.num_accepted[s]), expected_acc)
        np.testing.assert_array_equal(np.asarray(out.next_token[s]), expected_next)
        np.testing.assert_array_equal(
            np.asarray(out.accepted_mask[s]), np.arange(K)[None] < expected_acc[:, None]
        )

    # The engine's shortcut for all-greedy batches gives the same verdict from the argmax alone.
    greedy = jnp.zeros((B,)), jnp.ones((B,)), jnp.zeros((B,), jnp.int32)
    for verdict in (greedy_verify(jnp.asarray(draft_tok, jnp.int32),
                                  jnp.argmax(target_logits, -1).astype(jnp.int32),
                                  jnp.asarray(proposal_len)),
                    jax.jit(verify_logits)(keys[0], jnp.asarray(draft_tok, jnp.int32), q,
                                           target_logits, jnp.asarray(proposal_len), *greedy)):
        np.testing.assert_array_equal(np.asarray(verdict.num_accepted), expected_acc)
        np.testing.assert_array_equal(np.asarray(verdict.next_token), expected_next)
        np.testing.assert_array_equal(np.asarray(verdict.accepted_mask),
                                      np.asarray(out.accepted_mask[0]))


def test_argmax_takes_the_first_maximum():
    x = np.random.default_rng(3).integers(0, 4, size=(6, 5, 33)).astype(np.float32)  # many ties
    x[0, 0] = -np.inf
    x[0, 0, 7] = 2.0
    np.testing.assert_array_equal(np.asarray(jax.jit(argmax)(jnp.asarray(x))), np.argmax(x, -1))


# --------------------------------------------------------------------------------------------
# 3. End-to-end sampling, K = 1.

V_S, N_S = 6, 20000


def _sampling_setup():
    rng = np.random.default_rng(7)
    p = np.asarray(sampling_probs(jnp.asarray(rng.normal(size=(2, V_S)) * 1.5, jnp.float32)))
    q = np.asarray(sampling_probs(jnp.asarray(rng.normal(size=(1, V_S)) * 1.5, jnp.float32)))
    return jnp.asarray(p[None]), jnp.asarray(q[None]), p, q


def _draw(verifier):
    p, q, _, _ = _sampling_setup()

    def one(key):
        k_draft, k_verify = jax.random.split(key)
        x = sample_from_probs(k_draft, q)  # [1, 1]
        out = verifier(k_verify, x, q, p, jnp.ones((1,), jnp.int32))
        first = jnp.where(out.num_accepted[0] == 1, x[0, 0], out.next_token[0])
        return first, out.num_accepted[0], out.next_token[0]

    keys = jax.random.split(jax.random.key(20240607), N_S)
    first, acc, nxt = jax.jit(jax.vmap(one))(keys)
    return np.asarray(first), np.asarray(acc), np.asarray(nxt)


def _broken_verifier(key, x, q, p, n):
    """Accepts x when it equals an independent sample from p (wrong rule), then corrects from
    the residual exactly like the real sampler."""
    k_y, k_next = jax.random.split(key)
    y = sample_from_probs(k_y, p[:, 0])
    uniforms = jnp.where(y[:, None] == x, 0.0, 1.0)  # 1.0 is never < a
    d = verify_from_uniforms(uniforms, x, q, p, n)
    return VerifyResult(d.num_accepted, sample_from_probs(k_next, d.next_probs), d.accepted_mask)


def test_sampling_matches_target_law():
    _, _, p, q = _sampling_setup()
    first, acc, nxt = _draw(rejection_sample)
    stat, df = _chi2(np.bincount(first, minlength=V_S), p[0])
    assert stat < _CHI2_999[df], stat
    # The bonus token (drawn when the draft was accepted) follows the next target row.
    stat, df = _chi2(np.bincount(nxt[acc == 1], minlength=V_S), p[1])
    assert stat < _CHI2_999[df], stat
    # Acceptance rate sum_x min(p, q), within 4 standard deviations.
    rate = np.minimum(p[0], q[0]).sum()
    assert abs(acc.mean() - rate) < 4 * np.sqrt(rate * (1 - rate) / N_S)


def test_sampling_statistic_rejects_broken_sampler():
    _, _, p, _ = _sampling_setup()
    first, _, _ = _draw(_broken_verifier)
    stat, df = _chi2(np.bincount(first, minlength=V_S), p[0])
    assert stat > 10 * _CHI2_999[df], stat


# --------------------------------------------------------------------------------------------
# 4. proposal_len = 0 and padding.


def test_num_draft_zero_and_padding_never_accepted():
    V, K, B = 6, 4, 4
    rng = np.random.default_rng(3)
    p = np.asarray(sampling_probs(jnp.asarray(rng.normal(size=(B, K + 1, V)), jnp.float32)))
    # Every draft position would be accepted: the token t is the target argmax and
    # q = 0.5 p + 0.5 delta_{t+1} (ratio 2), whose residual max(p - q, 0) differs from p.
    tokens = np.argmax(p[:, :K], -1).astype(np.int32)
    q = 0.5 * p[:, :K] + 0.5 * np.eye(V, dtype=np.float32)[(tokens + 1) % V]
    proposal_len = np.array([0, 0, 2, 3], np.int32)
    a = np.asarray(_acceptance(tokens, q, p))
    np.testing.assert_array_equal(a, np.ones((B, K)))

    d = _verify(jnp.zeros((B, K)), tokens, q, p, proposal_len)
    np.testing.assert_array_equal(np.asarray(d.num_accepted), proposal_len)
    np.testing.assert_allclose(np.asarray(d.next_probs), p[np.arange(B), proposal_len], rtol=1e-6)

    n_keys = 4000
    keys = jax.random.split(jax.random.key(5), n_keys)
    run = jax.jit(jax.vmap(rejection_sample, in_axes=(0, None, None, None, None)))
    out = run(keys, jnp.asarray(tokens), jnp.asarray(q), jnp.asarray(p), jnp.asarray(proposal_len))
    acc = np.asarray(out.num_accepted)
    np.testing.assert_array_equal(acc, np.broadcast_to(proposal_len, acc.shape))
    np.testing.assert_array_equal(
        np.asarray(out.accepted_mask),
        np.broadcast_to(np.arange(K)[None] < proposal_len[:, None], (n_keys, B, K)),
    )
    nxt = np.asarray(out.next_token)
    for b in range(B):
        stat, df = _chi2(np.bincount(nxt[:, b], minlength=V), p[b, proposal_len[b]])
        assert stat < _CHI2_999[df], (b, stat)


# --------------------------------------------------------------------------------------------
# 5. One compilation for every key and value of a shape.


def test_compiles_once_per_shape():
    traces = []

    def traced(*args):
        traces.append(1)
        return rejection_sample(*args)

    fn = jax.jit(traced)
    rng = np.random.default_rng(11)
    B, K, V = 3, 4, 8
    for i in range(3):
        p = sampling_probs(jnp.asarray(rng.normal(size=(B, K + 1, V)), jnp.float32), 0.5 + i)
        q = sampling_probs(jnp.asarray(rng.normal(size=(B, K, V)), jnp.float32), 0.5 + i)
        tokens = jnp.asarray(rng.integers(0, V, size=(B, K)), jnp.int32)
        proposal_len = jnp.asarray(rng.integers(0, K + 1, size=B), jnp.int32)
        out = fn(jax.random.key(i), tokens, q, p, proposal_len)
        assert out.num_accepted.dtype == jnp.int32 and out.next_token.dtype == jnp.int32
        assert out.accepted_mask.dtype == jnp.bool_ and out.accepted_mask.shape == (B, K)
    assert len(traces) == 1
    if hasattr(fn, "_cache_size"):
        assert fn._cache_size() == 1
