"""Tests for dspark_jax.scheduling.policies (spec section 9, section 7 step 4)."""

from __future__ import annotations

import itertools
import math

import jax
import jax.numpy as jnp
import numpy as np

from dspark_jax.scheduling import (
    expected_throughput,
    fixed_proposal_len,
    full_block_proposal_len,
    global_search_capacity,
    prefix_schedule,
    production_schedule,
    survivals,
    threshold_proposal_len,
    throughput_curve,
    top_k_prefix_schedule,
)

# --------------------------------------------------------------------------- numpy references


def np_theta(a, lengths, sps, active):
    """Theta = tau * SPS(B) in float64; -inf when B is outside the table."""
    bmax = len(sps) - 1
    r_act = int(np.sum(active))
    batch = r_act + int(sum(l for l, on in zip(lengths, active) if on))
    if batch < 1 or batch > bmax:
        return -math.inf
    tau = r_act + sum(float(np.sum(a[r, :l])) for r, l in enumerate(lengths) if active[r])
    return tau * float(sps[batch])


def np_ranking(a, active):
    """Admissible candidates (r, j) sorted by survival desc, ties by (r, j)."""
    cands = [
        (r, j) for r in range(a.shape[0]) for j in range(a.shape[1]) if active[r] and a[r, j] > 0
    ]
    return sorted(cands, key=lambda rj: (-a[rj], rj[0], rj[1]))


def lengths_to_set(lengths):
    return {(r, j) for r, l in enumerate(lengths) for j in range(int(l))}


def np_algorithm1(a, sps, active):
    """Plain-loop Algorithm 1. Returns (admitted count, smallest comparison margin)."""
    bmax = len(sps) - 1
    r_act = int(np.sum(active))
    batch, tau = r_act, float(r_act)
    best = tau * float(sps[batch]) if 1 <= batch <= bmax else -math.inf
    count, margin = 0, math.inf
    for rj in np_ranking(a, active):
        batch += 1
        tau += float(a[rj])
        theta = tau * float(sps[batch]) if batch <= bmax else -math.inf
        if math.isfinite(theta) and math.isfinite(best):
            margin = min(margin, abs(theta - best))
        if theta > best:
            best, count = theta, count + 1
        else:
            break
    return count, margin


def brute_force(a, sps, active):
    """Theta of every length vector (inactive rows fixed at 0).

    Returns (best Theta over all vectors, dict k -> best Theta with sum(l) == k).
    """
    R, gamma = a.shape
    ranges = [range(gamma + 1) if active[r] else range(1) for r in range(R)]
    by_k = {}
    for lengths in itertools.product(*ranges):
        th = np_theta(a, lengths, sps, active)
        k = sum(lengths)
        by_k[k] = max(by_k.get(k, -math.inf), th)
    return max(by_k.values()), by_k


def first_argmax(values):
    best_k, best = 0, values[0]
    for k, v in enumerate(values):
        if v > best:
            best_k, best = k, v
    return best_k


def close(x, y, tol=1e-5):
    if math.isinf(x) or math.isinf(y):
        return x == y
    return abs(x - y) <= tol * max(1.0, abs(x), abs(y))


# --------------------------------------------------------------------------- 1. Appendix A

P_TARGET = np.array([0.7, 0.3])  # tokens {A, B}
Q_X1 = np.array([0.5, 0.5])  # draft law of x1
Q_X2 = np.array([0.5, 0.5])  # draft law of x2 (defined, irrelevant for the first emitted token)
SPS_APPENDIX_A = jnp.array([0.0, 1.0, 0.5, 0.45])  # SPS(1)=1.0, SPS(2)=0.5, SPS(3)=0.45


def appendix_a_confidences(x1):
    c2 = 0.9 if x1 == 0 else 0.0  # c_2 = 0.9 if x1 = A else 0
    return jnp.array([[0.8, c2]], dtype=jnp.float32)


def first_token_law(lengths_by_x1):
    """Exact law of the first emitted token given the verified length for each x1.

    l = 0: the target samples the first token from p.  l >= 1: standard rejection sampling
    of x1 ~ q (accept w.p. min(1, p/q), else resample from normalize(max(p - q, 0))).
    """
    residual = np.maximum(P_TARGET - Q_X1, 0.0)
    residual = residual / residual.sum()
    law = np.zeros(2)
    for x1 in (0, 1):
        if int(lengths_by_x1[x1]) == 0:
            law += Q_X1[x1] * P_TARGET
        else:
            acc = min(1.0, P_TARGET[x1] / Q_X1[x1])
            law[x1] += Q_X1[x1] * acc
            law += Q_X1[x1] * (1.0 - acc) * residual
    return law


def test_appendix_a_counterexample_exact_laws():
    # c_1 = 0.8 is exactly the standard acceptance probability sum min(p, q).
    assert abs(np.minimum(P_TARGET, Q_X1).sum() - 0.8) < 1e-12
    # Sanity of the law computation: always verifying x1 is lossless.
    np.testing.assert_allclose(first_token_law({0: 1, 1: 1}), P_TARGET, atol=1e-12)

    alg1, retro = {}, {}
    for x1 in (0, 1):
        conf = appendix_a_confidences(x1)
        # Theta by length given the realised c_2.
        thetas = [float(expected_throughput(conf, jnp.array([l]), SPS_APPENDIX_A)) for l in range(3)]
        expected_theta2 = (1 + 0.8 + 0.72) * 0.45 if x1 == 0 else (1 + 0.8) * 0.45
        np.testing.assert_allclose(thetas, [1.0, 0.9, expected_theta2], rtol=1e-6)
        # (a) Algorithm 1: Theta_1 = 0.9 <= Theta_0 = 1.0 -> stop before x1, whatever x1 is.
        alg1[x1] = int(prefix_schedule(conf, SPS_APPENDIX_A)[0])
        # (b) retrospective global argmax over lengths after seeing x1.
        retro[x1] = int(np.argmax(thetas))
        # ... which is what the unconstrained global search computes on realised confidences.
        k = global_search_capacity(conf, SPS_APPENDIX_A)
        assert int(top_k_prefix_schedule(conf, k)[0]) == retro[x1]

    assert alg1 == {0: 0, 1: 0}
    assert retro == {0: 2, 1: 0}
    np.testing.assert_allclose(first_token_law(alg1), [0.7, 0.3], atol=1e-9)
    np.testing.assert_allclose(first_token_law(retro), [0.85, 0.15], atol=1e-9)

    # Production variant: the capacity comes from lagged confidences that do not depend on
    # x1, so the length is the same for both x1 and the law is the target's.
    lagged = jnp.array([[0.8, 0.9]], dtype=jnp.float32)
    prod = {x1: int(production_schedule(appendix_a_confidences(x1), lagged, SPS_APPENDIX_A)[0])
            for x1 in (0, 1)}
    assert prod[0] == 2 and prod[1] == 1  # K = 2; for x1 = B only the positive prefix
    assert all(l >= 1 for l in prod.values())
    np.testing.assert_allclose(first_token_law(prod), [0.7, 0.3], atol=1e-9)


# --------------------------------------------------------------------------- 2. worked example

WORKED_CONF = jnp.array([[0.9, 0.8], [0.6, 0.5]], dtype=jnp.float32)
WORKED_SPS = jnp.array([1, 1, 1, 0.95, 0.90, 0.20, 0.10], dtype=jnp.float32)


def test_worked_example_spec_section_9():
    np.testing.assert_allclose(survivals(WORKED_CONF), [[0.9, 0.72], [0.6, 0.3]], rtol=1e-6)
    curve = np.asarray(throughput_curve(WORKED_CONF, WORKED_SPS))
    np.testing.assert_allclose(curve, [2.0, 2.755, 3.258, 0.844, 0.452], rtol=1e-5)
    # The same numbers from arbitrary length vectors along the admission path.
    path = [[0, 0], [1, 0], [2, 0], [2, 1], [2, 2]]
    thetas = [float(expected_throughput(WORKED_CONF, jnp.array(l), WORKED_SPS)) for l in path]
    np.testing.assert_allclose(thetas, [2.0, 2.755, 3.258, 0.844, 0.452], rtol=1e-5)
    # Budget 2: both candidates are r0's (0.9 and 0.72 > 0.6).
    np.testing.assert_array_equal(prefix_schedule(WORKED_CONF, WORKED_SPS), [2, 0])
    assert int(global_search_capacity(WORKED_CONF, WORKED_SPS)) == 2
    np.testing.assert_array_equal(top_k_prefix_schedule(WORKED_CONF, 2), [2, 0])
    np.testing.assert_array_equal(top_k_prefix_schedule(WORKED_CONF, 3), [2, 1])
    np.testing.assert_array_equal(
        production_schedule(WORKED_CONF, WORKED_CONF, WORKED_SPS), [2, 0]
    )


def test_global_search_crosses_sps_cliff_where_algorithm1_stops():
    conf = jnp.array([[0.9, 0.9], [0.8, 0.8]], dtype=jnp.float32)  # a = .9 .81 | .8 .64
    sps = jnp.array([0.0, 1.0, 1.0, 0.6, 0.6, 0.6, 0.6], dtype=jnp.float32)
    # Theta: k=0 -> 2.0, k=1 -> 1.74 (cliff), k=4 -> 5.15 * 0.6 = 3.09.
    np.testing.assert_array_equal(prefix_schedule(conf, sps), [0, 0])
    assert int(global_search_capacity(conf, sps)) == 4
    np.testing.assert_array_equal(production_schedule(conf, conf, sps), [2, 2])


def test_ties_go_to_the_lower_request_index():
    conf = jnp.array([[0.5, 1.0], [0.5, 1.0], [0.25, 1.0]], dtype=jnp.float32)
    # Survivals: r0 = r1 = [0.5, 0.5], r2 = [0.25, 0.25].  Ranking: (0,0) (0,1) (1,0) (1,1) ...
    for k, expected in [(1, [1, 0, 0]), (2, [2, 0, 0]), (3, [2, 1, 0]), (5, [2, 2, 1])]:
        np.testing.assert_array_equal(top_k_prefix_schedule(conf, k), expected)
    sps = jnp.array([0.0, 1, 1, 1, 0.9, 0.85, 0.1, 0.1], dtype=jnp.float32)
    # Theta: 3.0 -> 3.5*0.9 = 3.15 -> 4.0*0.85 = 3.4 -> 4.5*0.1: two admissions.
    np.testing.assert_array_equal(prefix_schedule(conf, sps), [2, 0, 0])
    assert int(global_search_capacity(conf, sps)) == 2


def test_out_of_table_batch_sizes_are_not_admissible():
    conf = jnp.array([[0.9, 0.9, 0.9]], dtype=jnp.float32)
    short = jnp.array([0.0, 1.0, 1.0], dtype=jnp.float32)  # Bmax = 2: one draft at most
    np.testing.assert_array_equal(prefix_schedule(conf, short), [1])
    assert int(global_search_capacity(conf, short)) == 1
    assert np.isneginf(float(expected_throughput(conf, jnp.array([2]), short)))
    curve = np.asarray(throughput_curve(conf, short))
    assert np.isfinite(curve[:2]).all() and np.isneginf(curve[2:]).all()
    # Anchors alone beyond the table: no drafts at all.
    conf3 = jnp.full((3, 2), 0.9, dtype=jnp.float32)
    np.testing.assert_array_equal(prefix_schedule(conf3, short), [0, 0, 0])
    assert int(global_search_capacity(conf3, short)) == 0
    np.testing.assert_array_equal(production_schedule(conf3, conf3, short), [0, 0, 0])


# --------------------------------------------------------------------------- 3. properties


def _all_outputs(conf, sps, active):
    k = global_search_capacity(conf, sps, active)
    return dict(
        a=survivals(conf),
        alg1=prefix_schedule(conf, sps, active),
        cap=k,
        curve=throughput_curve(conf, sps, active),
        topk=top_k_prefix_schedule(conf, k, active),
        prod=production_schedule(conf, conf, sps, active),
    )


_batched_outputs = jax.jit(jax.vmap(_all_outputs))


def _random_conf(rng, R, gamma):
    c = rng.uniform(0.0, 1.0, size=(R, gamma))
    u = rng.uniform(size=(R, gamma))
    c[u < 0.15] = 0.0
    c[(u >= 0.15) & (u < 0.3)] = 1.0
    c[(u >= 0.3) & (u < 0.4)] = 0.5  # exact ties across requests
    return c.astype(np.float32)


def _random_sps(rng, bmax, kind):
    b = np.arange(bmax + 1, dtype=np.float64)
    if kind == "flat":
        s = np.ones(bmax + 1)
    elif kind == "unimodal":  # log-concave and decreasing -> Theta unimodal on the path
        beta, p = rng.uniform(0.005, 0.3), rng.uniform(1.0, 2.5)
        s = np.exp(-beta * b**p)
    else:  # step-shaped, non-increasing, with cliffs
        s = np.ones(bmax + 1)
        for i in range(2, bmax + 1):
            s[i] = s[i - 1] * (rng.uniform(0.3, 0.95) if rng.uniform() < 0.35 else 1.0)
    s[0] = rng.uniform(0.0, 5.0)  # never read
    return s.astype(np.float32)


def _is_unimodal(values, tol=1e-9):
    vals = [v for v in values if math.isfinite(v)]
    i = 0
    while i + 1 < len(vals) and vals[i + 1] >= vals[i] - tol:
        i += 1
    return all(vals[j + 1] <= vals[j] + tol for j in range(i, len(vals) - 1))


def test_random_properties_against_brute_force():
    rng = np.random.default_rng(1234)
    kinds = ("flat", "unimodal", "step")
    checked = skipped = unimodal_checked = 0
    for R, gamma in itertools.product((1, 2, 3), (1, 2, 3)):
        n = 24
        full = R * (gamma + 1)
        bmax = int(rng.integers(full - gamma, full + 3))  # sometimes a short table
        confs = np.stack([_random_conf(rng, R, gamma) for _ in range(n)])
        kind_of = [kinds[i % 3] for i in range(n)]
        spss = np.stack([_random_sps(rng, bmax, kind) for kind in kind_of])
        actives = rng.uniform(size=(n, R)) < 0.8
        out = jax.tree.map(np.asarray, _batched_outputs(confs, spss, actives))

        for i in range(n):
            a = out["a"][i].astype(np.float64)  # float32 survivals, as the scheduler ranks them
            np.testing.assert_allclose(a, np.cumprod(confs[i].astype(np.float64), 1), rtol=1e-6)
            sps, active, kind = spss[i].astype(np.float64), actives[i], kind_of[i]
            order = np_ranking(a, active)
            n_pos = len(order)
            r_act = int(active.sum())
            best, by_k = brute_force(a, sps, active)
            curve_ref = [by_k[k] if k <= n_pos else -math.inf for k in range(R * gamma + 1)]

            for name in ("alg1", "topk", "prod"):
                lengths = out[name][i]
                # Inactive rows verify nothing; zero-survival positions are never admitted.
                assert (lengths[~active] == 0).all(), name
                for r in range(R):
                    assert lengths[r] == 0 or a[r, lengths[r] - 1] > 0, name
                # The admitted set is a per-request prefix AND the top of the global ranking.
                m = int(lengths.sum())
                assert lengths_to_set(lengths) == set(order[:m]), name

            # Theta along the admission path matches the brute force per k.
            for k in range(R * gamma + 1):
                assert close(float(out["curve"][i][k]), curve_ref[k]), (k, out["curve"][i], curve_ref)

            # Algorithm 1 == plain-loop Algorithm 1 (skip float32-vs-float64 near ties).
            count, margin = np_algorithm1(a, sps, active)
            if margin > 1e-5:
                assert int(out["alg1"][i].sum()) == count
                checked += 1
            else:
                skipped += 1

            # Global search capacity == brute-force argmax over k (smallest k on ties).
            k_ref = first_argmax(curve_ref)
            k_got = int(out["cap"][i])
            second = max([v for k, v in enumerate(curve_ref) if k != k_ref] + [-math.inf])
            if math.isfinite(best) and best - second > 1e-5 * max(1.0, best):
                assert k_got == k_ref, (k_got, k_ref, curve_ref)
            assert close(curve_ref[k_got], best)
            assert int(out["topk"][i].sum()) == min(k_got, n_pos)
            # Production with lagged == current reaches the global optimum, cliffs included.
            assert close(np_theta(a, out["prod"][i], sps, active), best)

            if kind == "flat":  # everything with positive survival that fits the table
                assert int(out["alg1"][i].sum()) == max(0, min(n_pos, bmax - r_act))
            if kind != "step":
                path = [th for th in curve_ref if math.isfinite(th)]
                assert _is_unimodal(path), path
                # Unimodal Theta: Algorithm 1 attains the optimum over ALL length vectors.
                assert close(np_theta(a, out["alg1"][i], sps, active), best), (
                    out["alg1"][i], best, curve_ref)
                unimodal_checked += 1
    assert checked >= 180 and skipped <= 20, (checked, skipped)
    assert unimodal_checked >= 140


# --------------------------------------------------------------------------- 4. threshold


def _threshold_ref(c, threshold):
    gamma = c.shape[1]
    out = []
    for row in c:
        if threshold <= 0:
            out.append(gamma)
            continue
        n = 0
        for x in row:
            if x < threshold:
                break
            n += 1
        out.append(n)
    return out


def test_threshold_lengths_matches_python_loop():
    rng = np.random.default_rng(7)
    R, gamma = 6, 5
    c = rng.uniform(size=(40, R, gamma)).astype(np.float32)
    c[:, :, 2] = np.float32(0.5)  # exact equality with a threshold: c < t is False -> kept
    thresholds = np.concatenate(
        [np.array([0.0, -0.3, 0.5, 1.0, 1.5]), rng.uniform(size=35)]
    ).astype(np.float32)
    got = np.asarray(jax.jit(jax.vmap(threshold_proposal_len))(c, thresholds))
    for i in range(len(thresholds)):
        assert list(got[i]) == _threshold_ref(c[i], float(thresholds[i])), i
    assert (got[0] == gamma).all() and (got[1] == gamma).all()  # threshold <= 0: full block
    assert (got[4] == 0).all()  # threshold above any confidence: nothing kept


def test_fixed_and_full_block_baselines():
    np.testing.assert_array_equal(fixed_proposal_len(3, 4, 1), [1, 1, 1])  # MTP-1 analogue
    np.testing.assert_array_equal(fixed_proposal_len(3, 4, 9), [4, 4, 4])  # clipped to gamma
    np.testing.assert_array_equal(full_block_proposal_len(2, 7), [7, 7])
    np.testing.assert_array_equal(
        full_block_proposal_len(3, 5, active=jnp.array([True, False, True])), [5, 0, 5]
    )


# --------------------------------------------------------------------------- 5. jit + active


def test_jit_with_traced_arguments_and_active_masks():
    conf = jnp.array([[0.9, 0.8], [0.99, 0.99]], dtype=jnp.float32)
    sps = jnp.array([0.0, 1.0, 1.0, 0.5, 0.1, 0.1], dtype=jnp.float32)
    active = jnp.array([True, False])

    j_alg1 = jax.jit(prefix_schedule)
    j_cap = jax.jit(global_search_capacity)
    j_topk = jax.jit(top_k_prefix_schedule)
    j_prod = jax.jit(production_schedule)
    j_thr = jax.jit(threshold_proposal_len)
    j_fixed = jax.jit(fixed_proposal_len, static_argnums=(0, 1))
    j_theta = jax.jit(expected_throughput)

    # Row 1 inactive: B starts at 1 (Theta 1 -> 1.9 -> 1.31): lengths [1, 0].  Counting the
    # inactive anchor (B starts at 2) would give [0, 0]; admitting its 0.99s would differ too.
    np.testing.assert_array_equal(j_alg1(conf, sps, active), [1, 0])
    np.testing.assert_array_equal(j_alg1(conf[:1], sps), [1])
    np.testing.assert_array_equal(j_alg1(conf, sps), prefix_schedule(conf, sps))
    assert int(j_cap(conf, sps, active)) == 1
    np.testing.assert_array_equal(j_topk(conf, jnp.int32(2), active), [2, 0])
    np.testing.assert_array_equal(j_topk(conf, jnp.int32(3), None), [1, 2])
    np.testing.assert_array_equal(j_prod(conf, conf, sps, active), [1, 0])
    np.testing.assert_array_equal(j_thr(conf, jnp.float32(0.85), active), [1, 0])
    np.testing.assert_array_equal(j_thr(conf, jnp.float32(0.0), active), [2, 0])
    np.testing.assert_array_equal(j_fixed(2, 3, jnp.int32(1), active), [1, 0])
    np.testing.assert_allclose(float(j_theta(conf, jnp.array([1, 2]), sps, active)), 1.9)
    none_active = jnp.array([False, False])
    np.testing.assert_array_equal(j_alg1(conf, sps, none_active), [0, 0])
    assert int(j_cap(conf, sps, none_active)) == 0

    # Masked rows behave exactly as if the active rows were scheduled alone.
    rng = np.random.default_rng(3)
    R, gamma = 4, 3
    sub_alg1 = jax.jit(prefix_schedule)
    for _ in range(6):
        c = _random_conf(rng, R, gamma)
        s = _random_sps(rng, R * (gamma + 1), "step")
        act = rng.uniform(size=R) < 0.6
        act[0] = True
        idx = np.flatnonzero(act)
        got = np.asarray(j_alg1(c, s, act))
        assert (got[~act] == 0).all()
        np.testing.assert_array_equal(got[idx], sub_alg1(c[idx], s))
        assert int(j_cap(c, s, act)) == int(global_search_capacity(c[idx], s))

