"""Shared helpers of the output-law tests: the exact law of the first three tokens, the
chi-square statistic against it, a drafter whose confidences depend on the drafted tokens
(paper Appendix A), and policy probes for the callable-policy interface."""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np

import dspark_jax
from dspark_jax.scheduling import production_schedule
from dspark_jax.target import init_target

LAW_TARGET = dict(architectures=["Qwen3ForCausalLM"], vocab_size=16, hidden_size=32,
                  intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=8, eos_token_id=None,
                  max_position_embeddings=512)
PROMPT = [1, 2, 3]


def law_models(*, token_dependent_confidence: bool = False):
    """(target, drafter) over a 16-token vocabulary, block 3 (P = 3).

    A larger LM head makes the target (and the drafter, which shares it) far from uniform, and
    the two disagree, so a wrong acceptance rule visibly changes the output law. With
    ``token_dependent_confidence`` the confidence head reads only W1[prev][0], set to +20 for
    even and -20 for odd tokens: c_{k+1} is ~1 when the drafted x_k is even and ~0 when it is
    odd, the dependence that makes a capacity search over the current block lossy.
    """
    target = init_target(LAW_TARGET, seed=7)
    target.state["lm_head"].set_value(target.state["lm_head"].get_value() * 25)
    drafter = dspark_jax.init_drafter(target, seed=8, block_size=3)
    if token_dependent_confidence:
        hidden = LAW_TARGET["hidden_size"]
        proj = drafter.state["confidence_head"]["proj"]
        kernel = np.zeros(proj["kernel"].get_value().shape, np.float32)
        kernel[hidden] = 1.0  # the first feature of W1[prev]
        proj["kernel"].set_value(jnp.asarray(kernel))
        proj["bias"].set_value(jnp.zeros_like(proj["bias"].get_value()))
        table = drafter.state["markov_head"]["markov_w1"]["embedding"]
        rows = np.array(table.get_value())
        rows[:, 0] = np.where(np.arange(rows.shape[0]) % 2 == 0, 20.0, -20.0)
        table.set_value(jnp.asarray(rows))
    return target, drafter


# Steps/s by forward tokens for one request with P = 3: Theta(0) = 1 and Theta(k) =
# 0.45 (1 + a_1 + .. + a_k), so the global search verifies drafts only when a_1 + a_2 > 1.22,
# i.e. only when c_2 -- which depends on the drafted x_1 -- is high.
ONE_REQUEST_SPS = [1.0, 1.0, 0.45, 0.45, 0.45]


def production_per_request(confidences, lagged, active, params):
    """The production scheduler run for each request alone (batch-1 semantics on every row).

    confidences, lagged: float [b, P]; active: bool [b] -> int32 [b]."""
    def one(current, before, on):
        return production_schedule(current[None], before[None], params["sps"], on[None])[0]
    return jax.vmap(one)(confidences, lagged, active)


POLICY_CALLS: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []


def recording_policy(confidences, lagged, active, params):
    """Verifies full blocks and appends (confidences, lagged, active) of every call to
    POLICY_CALLS (host callback, in call order)."""
    del params
    jax.debug.callback(lambda *a: POLICY_CALLS.append(tuple(np.asarray(x) for x in a)),
                       confidences, lagged, active, ordered=True)
    return jnp.where(active, confidences.shape[1], 0).astype(jnp.int32)


def exact_law(target, length: int = 3, prompt=PROMPT) -> np.ndarray:
    """The target's joint law p(t1 .. t_length) [V] * length after ``prompt``, chained from its
    logits over every prefix."""
    vocab = target.config.vocab_size
    joint = np.ones(())
    for i in range(length):
        prefixes = np.array([list(prompt) + list(p)
                             for p in itertools.product(range(vocab), repeat=i)])
        logits = target.logits(prefixes)[:, -1]
        probs = np.exp(logits - logits.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        joint = joint[..., None] * probs.reshape((vocab,) * i + (vocab,))
    return joint


def marginal_law(target, positions) -> np.ndarray:
    """The target's exact law of the generated tokens at ``positions`` (0-based, increasing),
    marginalised from :func:`exact_law` over the tokens before and between them."""
    length = max(positions) + 1
    joint = exact_law(target, length)
    return joint.sum(axis=tuple(i for i in range(length) if i not in positions))


def chi_square(samples, law: np.ndarray) -> tuple[float, int, float]:
    """(chi2, degrees of freedom, 99.9% bound) of ``samples`` (token tuples of length
    ``law.ndim``) against ``law``; cells expecting fewer than 5 are pooled."""
    counts = np.zeros(law.shape)
    for tokens in samples:
        counts[tuple(tokens)] += 1
    expected = law * len(samples)
    big = expected >= 5
    chi2 = float(((counts[big] - expected[big]) ** 2 / expected[big]).sum())
    rest_obs, rest_exp = counts[~big].sum(), expected[~big].sum()
    if rest_exp > 0:
        chi2 += (rest_obs - rest_exp) ** 2 / rest_exp
    dof = int(big.sum()) + (rest_exp > 0) - 1
    # 99.9% quantile of chi-square ~ dof + 3.09 sqrt(2 dof) + (2/3)(3.09^2 - 1) for large dof.
    return chi2, dof, dof + 3.09 * np.sqrt(2 * dof) + 6
