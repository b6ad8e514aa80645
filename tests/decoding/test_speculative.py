"""Speculative decoding engine on tiny random targets: greedy equality, exact law, compiles."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dspark_jax
from dspark_jax import generation
from dspark_jax.decoding import rejection, speculative
from dspark_jax.decoding.sampling import sample_from_probs
from dspark_jax.models.decoder import Decoder
from dspark_jax.target import init_target

QWEN3 = dict(architectures=["Qwen3ForCausalLM"], vocab_size=48, hidden_size=32, intermediate_size=64,
             num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
             eos_token_id=3, max_position_embeddings=512)
LLAMA = dict(QWEN3, architectures=["LlamaForCausalLM"], num_attention_heads=2, num_key_value_heads=1,
             head_dim=16)
PROMPTS = [[5, 9, 11, 7], [4, 8, 15, 16, 23, 42, 7, 6, 10, 12, 14, 20, 21, 22, 30, 31, 32, 33], [17]]


@pytest.fixture(scope="module")
def qwen3():
    return init_target(QWEN3, seed=1)


@pytest.fixture(scope="module")
def ar_reference(qwen3):
    return [r.token_ids for r in dspark_jax.generate(qwen3, PROMPTS, max_new_tokens=24)]


# Every verification policy and every drafter head, each pair one compiled program.
@pytest.mark.parametrize("verify,params,overrides", [
    ("full", None, dict(head="none")),
    ("fixed", {"gamma": 2}, dict(block_size=4)),
    ("threshold", {"threshold": 0.5}, dict(head="gated")),
    ("prefix", None, dict(head="rnn")),
    ("production", {"sps": [1.0] * 6 + [0.5] * 20}, dict()),
])
def test_greedy_equals_autoregressive_for_every_policy_and_head(qwen3, ar_reference, verify,
                                                                params, overrides):
    drafter = dspark_jax.init_drafter(qwen3, seed=2, **overrides)
    results = dspark_jax.generate(qwen3, PROMPTS, max_new_tokens=24, drafter=drafter,
                                  verify=verify, verify_params=params)
    assert [r.token_ids for r in results] == ar_reference


def test_greedy_llama_target():
    target = init_target(LLAMA, seed=4)
    drafter = dspark_jax.init_drafter(target, seed=5)
    ar = dspark_jax.generate(target, PROMPTS, max_new_tokens=16)
    sp = dspark_jax.generate(target, PROMPTS, max_new_tokens=16, drafter=drafter)
    assert [r.token_ids for r in sp] == [r.token_ids for r in ar]


def test_mixed_lengths_batch_equals_each_alone(qwen3):
    drafter = dspark_jax.init_drafter(qwen3, seed=2)
    batched = dspark_jax.generate(qwen3, PROMPTS, max_new_tokens=20, drafter=drafter)
    for prompt, res in zip(PROMPTS, batched):
        alone = dspark_jax.generate(qwen3, [prompt], max_new_tokens=20, drafter=drafter)[0]
        assert res.token_ids == alone.token_ids
        assert res.stats["counters"] == alone.stats["counters"]


def test_statistics_are_consistent(qwen3):
    drafter = dspark_jax.init_drafter(qwen3, seed=2)
    results = dspark_jax.generate(qwen3, PROMPTS, max_new_tokens=30, drafter=drafter,
                                  temperature=1.0, seed=3, verify="threshold",
                                  verify_params={"threshold": 0.45})
    for r in results:
        s, c = r.stats, r.stats["counters"]
        assert s["rounds"] >= 1 and s["tau"] == pytest.approx(c["tau_sum"] / c["rounds"])
        # Every emitted token after the first comes from a round; the last round may be cut.
        assert r.stats["new_tokens"] - 1 <= c["tau_sum"] <= r.stats["new_tokens"] - 1 + 8
        assert c["accepted"] <= c["proposed"]
        assert all(a <= p for a, p in zip(c["accepted_ge"], c["proposed_ge"]))
        assert all(x >= y for x, y in zip(c["accepted_ge"], c["accepted_ge"][1:]))
        assert s["verify_rate"] == pytest.approx(c["accepted"] / (c["proposed"] + c["rounds"]))
        rates = [x for x in s["accept_rate_at_k"] if x is not None]
        assert all(0 <= x <= 1 for x in rates)


def test_compiles_once_and_traces_each_bucket_once(qwen3, monkeypatch):
    """Varying verification lengths: one program, one verify shape per bucket."""
    drafter = dspark_jax.init_drafter(qwen3, seed=2)
    widths = []
    original = Decoder.__call__

    def recording(self, tokens, *args, **kwargs):
        widths.append(tokens.shape[1])
        return original(self, tokens, *args, **kwargs)

    monkeypatch.setattr(Decoder, "__call__", recording)
    generation._PROGRAMS.clear()
    lengths = set()
    for i, threshold in enumerate((0.3, 0.45, 0.5, 0.55, 0.7)):
        res = dspark_jax.generate(qwen3, PROMPTS, max_new_tokens=20, drafter=drafter,
                                  temperature=1.0, seed=i, verify="threshold",
                                  verify_params={"threshold": threshold})
        assert (res[0].stats["compile_s"] > 0) == (i == 0)
        for r in res:
            # rounds verifying >= k drafts, k = 0..7; a drop from k to k+1 means length k occurred
            at_least = [r.stats["rounds"]] + r.stats["counters"]["proposed_ge"] + [0]
            lengths |= {k for k in range(8) if at_least[k] > at_least[k + 1]}
    assert len(lengths) >= 3  # the runs really verified several different lengths
    buckets = (1, 2, 4, 8)
    assert sorted(w for w in widths if w <= 8) == list(buckets)  # one trace per verify bucket


def _broken_rejection(key, draft_tokens, draft_probs, target_probs, num_draft):
    """Accepts x_k when it equals a fresh sample of p_k: NOT the target law."""
    k1, k2 = jax.random.split(key)
    size = draft_tokens.shape[1]
    samples = sample_from_probs(k1, target_probs[:, :size])
    ok = (samples == draft_tokens) & (jnp.arange(size)[None] < num_draft[:, None])
    accepted = jnp.cumprod(ok, axis=1).sum(axis=1).astype(jnp.int32)
    nxt = sample_from_probs(k2, target_probs[jnp.arange(draft_tokens.shape[0]), accepted])
    return rejection.VerifyResult(accepted, nxt, jnp.arange(size)[None] < accepted[:, None])


def _first_tokens_chi2(target, drafter, n, verify="full", params=None, seed=0):
    """Chi-square of the law of the first three generated tokens against the exact law."""
    prompt = [1, 2, 3]
    res = dspark_jax.generate(target, [prompt] * n, max_new_tokens=3, temperature=1.0, seed=seed,
                              drafter=drafter, verify=verify, verify_params=params)
    vocab = target.config.vocab_size
    counts = np.zeros((vocab,) * 3)
    for r in res:
        counts[tuple(r.token_ids[:3])] += 1
    # Exact law: p(t1) p(t2|t1) p(t3|t1,t2) from the target's logits over every prefix.
    prefixes = np.array([prompt + list(p) for p in itertools.product(range(vocab), repeat=2)])
    logits = target.logits(prefixes)
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    first = probs[0, len(prompt) - 1]  # p(t1)
    second = probs[:, len(prompt)].reshape(vocab, vocab, vocab)[:, 0, :]  # p(t2 | t1)
    third = probs[:, len(prompt) + 1].reshape(vocab, vocab, vocab)  # p(t3 | t1, t2)
    law = first[:, None, None] * second[:, :, None] * third
    expected = law * n
    big = expected >= 5
    chi2 = float(((counts[big] - expected[big]) ** 2 / expected[big]).sum())
    rest_obs, rest_exp = counts[~big].sum(), expected[~big].sum()
    if rest_exp > 0:
        chi2 += (rest_obs - rest_exp) ** 2 / rest_exp
    dof = int(big.sum()) + (rest_exp > 0) - 1
    return chi2, dof


@pytest.fixture(scope="module")
def law_models():
    config = dict(QWEN3, vocab_size=16, eos_token_id=None)
    target = init_target(config, seed=7)
    # A larger LM head makes the target (and the drafter, which shares it) far from uniform,
    # and the two disagree, so a wrong acceptance rule visibly changes the output law.
    target.state["lm_head"].set_value(target.state["lm_head"].get_value() * 25)
    return target, dspark_jax.init_drafter(target, seed=8, block_size=3)


@pytest.mark.parametrize("verify,params", [
    ("full", None), ("production", {"sps": [1.0] * 35001 + [0.5] * 45000})])
def test_output_law_is_the_target_law(law_models, verify, params):
    target, drafter = law_models
    chi2, dof = _first_tokens_chi2(target, drafter, 20000, verify, params)
    # 99.9% quantile of chi-square ~ dof + 3.09 sqrt(2 dof) + (2/3)(3.09^2 - 1) for large dof.
    assert chi2 < dof + 3.09 * np.sqrt(2 * dof) + 6, (chi2, dof)


def test_broken_sampler_fails_the_law_test(law_models, monkeypatch):
    target, drafter = law_models
    monkeypatch.setattr(speculative.rejection, "rejection_sample", _broken_rejection)
    generation._PROGRAMS.clear()
    try:
        chi2, dof = _first_tokens_chi2(target, drafter, 8000)  # ~2x the bound at this size
    finally:
        generation._PROGRAMS.clear()
    assert chi2 > dof + 3.09 * np.sqrt(2 * dof) + 6, (chi2, dof)


def test_drafter_of_another_target_is_refused(qwen3):
    other = init_target(QWEN3, seed=9)
    drafter = dspark_jax.init_drafter(other)
    with pytest.raises(ValueError, match="another target"):
        dspark_jax.generate(qwen3, PROMPTS, max_new_tokens=4, drafter=drafter)


def test_unknown_policy_is_refused(qwen3):
    drafter = dspark_jax.init_drafter(qwen3)
    with pytest.raises(ValueError, match="unknown verification policy"):
        dspark_jax.generate(qwen3, PROMPTS, max_new_tokens=4, drafter=drafter, verify="sometimes")
