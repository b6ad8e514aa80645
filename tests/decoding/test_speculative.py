"""Speculative decoding engine on tiny random targets: greedy equality, exact law, compiles."""

import warnings

import jax.numpy as jnp
import numpy as np
import pytest

import dspark_jax
import law
from dspark_jax import engine
from dspark_jax.decoding import rejection
from dspark_jax.decoding import round as round_lib
from dspark_jax.decoding.sampling import sample_from_probs, split_key
from dspark_jax.engine.stats import sum_counters
from dspark_jax.target import init_target

QWEN3 = dict(architectures=["Qwen3ForCausalLM"], vocab_size=48, hidden_size=32, intermediate_size=64,
             num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
             eos_token_id=3, max_position_embeddings=512)
LLAMA = dict(QWEN3, architectures=["LlamaForCausalLM"], num_attention_heads=2, num_key_value_heads=1,
             head_dim=16)
GEMMA3 = dict(QWEN3, architectures=["Gemma3ForCausalLM"], sliding_window=6, query_pre_attn_scalar=6,
              layer_types=["sliding_attention", "full_attention"] * 2, final_logit_softcapping=5.0)
GEMMA4 = dict(GEMMA3, architectures=["Gemma4ForCausalLM"], global_head_dim=32,
              num_global_key_value_heads=1, attention_k_eq_v=True, hidden_size_per_layer_input=0)
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
    # The other heads' block samplers are checked in the default run (test_block_sampler.py).
    pytest.param("fixed", {"gamma": 2}, dict(block_size=4), marks=pytest.mark.slow),
    pytest.param("threshold", {"threshold": 0.5}, dict(head="gated"), marks=pytest.mark.slow),
    pytest.param("prefix", {"sps": [1.0] * 25}, dict(head="rnn"), marks=pytest.mark.slow),
    ("production", {"sps": [1.0] * 6 + [0.5] * 20}, dict()),
])
def test_greedy_equals_autoregressive_for_every_policy_and_head(qwen3, ar_reference, verify,
                                                                params, overrides):
    drafter = dspark_jax.init_drafter(qwen3, seed=2, **overrides)
    results = dspark_jax.generate(qwen3, PROMPTS, max_new_tokens=24, drafter=drafter,
                                  verify=verify, verify_params=params)
    assert [r.token_ids for r in results] == ar_reference


def test_greedy_with_a_draft_vocabulary_equals_autoregressive(qwen3, ar_reference):
    """A drafter restricted to 16 of the 48 tokens (``Drafter.restrict_vocab``) drafts a
    narrower law; greedy output is still the target's own."""
    drafter = dspark_jax.init_drafter(qwen3, seed=2)
    drafter.restrict_vocab(np.arange(0, 48, 3))
    res = dspark_jax.generate(qwen3, PROMPTS, max_new_tokens=24, drafter=drafter)
    assert [r.token_ids for r in res] == ar_reference


@pytest.mark.slow  # the default run's engine tests use a Qwen3 target
@pytest.mark.parametrize("config", [LLAMA, GEMMA3, GEMMA4],
                         ids=["llama", "gemma3", "gemma4"])
def test_greedy_other_target_families(config):
    """Llama, and Gemma3 / Gemma4 with 6-token windows (shorter than the prompts plus 16 new
    tokens); Gemma4's full layers have their own shape and its drafter's layers theirs."""
    target = init_target(config, seed=4)
    drafter = dspark_jax.init_drafter(target, seed=5)
    ar = dspark_jax.generate(target, PROMPTS, max_new_tokens=16)
    sp = dspark_jax.generate(target, PROMPTS, max_new_tokens=16, drafter=drafter)
    assert [r.token_ids for r in sp] == [r.token_ids for r in ar]


@pytest.mark.slow  # four programs; test_generation.py checks the same for autoregressive rows
def test_mixed_lengths_batch_equals_each_alone(qwen3):
    drafter = dspark_jax.init_drafter(qwen3, seed=2)
    batched = dspark_jax.generate(qwen3, PROMPTS, max_new_tokens=20, drafter=drafter)
    for prompt, res in zip(PROMPTS, batched):
        alone = dspark_jax.generate(qwen3, [prompt], max_new_tokens=20, drafter=drafter)[0]
        assert res.token_ids == alone.token_ids
        assert res.stats["counters"] == alone.stats["counters"]


@pytest.mark.slow  # with the threshold policy's other checks
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
        assert c["accepted"] <= c["proposal_len_sum"]
        assert all(a <= p for a, p in zip(c["accepted_ge"], c["proposal_len_ge"]))
        assert all(x >= y for x, y in zip(c["accepted_ge"], c["accepted_ge"][1:]))
        assert s["verify_rate"] == pytest.approx(c["accepted"] / (c["proposal_len_sum"] + c["rounds"]))
        rates = [x for x in s["accept_rate_at_k"] if x is not None]
        assert all(0 <= x <= 1 for x in rates)


def test_compiles_once_and_traces_each_bucket_once(qwen3, monkeypatch):
    """Varying verification lengths: one program, one verify shape per flat token bucket (and
    one prefill of the three prompts laid out flat: 23 tokens in a 32-token bucket)."""
    drafter = dspark_jax.init_drafter(qwen3, seed=2)
    widths = []
    original = round_lib.ragged_forward

    def recording(model, tokens, *args, **kwargs):
        widths.append(tokens.shape[0])
        return original(model, tokens, *args, **kwargs)

    monkeypatch.setattr(round_lib, "ragged_forward", recording)
    engine.clear_compiled_programs()
    lengths = set()
    for i, threshold in enumerate((0.3, 0.45, 0.5, 0.55, 0.7)):
        res = dspark_jax.generate(qwen3, PROMPTS, max_new_tokens=20, drafter=drafter,
                                  temperature=1.0, seed=i, verify="threshold",
                                  verify_params={"threshold": threshold})
        assert (res[0].stats["compile_s"] > 0) == (i == 0)
        for r in res:
            # rounds verifying >= k drafts, k = 0..7; a drop from k to k+1 means length k occurred
            at_least = [r.stats["rounds"]] + r.stats["counters"]["proposal_len_ge"] + [0]
            lengths |= {k for k in range(8) if at_least[k] > at_least[k + 1]}
    assert len(lengths) >= 3  # the runs really verified several different lengths
    buckets = engine.token_buckets(len(PROMPTS), drafter.num_proposals)
    assert buckets == (1, 2, 4, 8, 16, 24)
    assert sorted(widths) == sorted(buckets + (32,))  # one trace per verify bucket, one prefill


def _broken_rejection(key, draft_tokens, draft_probs, target_probs, proposal_len):
    """Accepts x_k when it equals a fresh sample of p_k: NOT the target law."""
    k1, k2 = split_key(key)  # one key per request
    size = draft_tokens.shape[1]
    samples = sample_from_probs(k1, target_probs[:, :size])
    ok = (samples == draft_tokens) & (jnp.arange(size)[None] < proposal_len[:, None])
    accepted = jnp.cumprod(ok, axis=1).sum(axis=1).astype(jnp.int32)
    nxt = sample_from_probs(k2, target_probs[jnp.arange(draft_tokens.shape[0]), accepted])
    return rejection.VerifyResult(accepted, nxt, jnp.arange(size)[None] < accepted[:, None])


def _law_chi2(target, drafter, n, verify="full", params=None, positions=(0, 1, 2)):
    """(chi2, dof, 99.9% bound) of the generated tokens at ``positions`` against the exact law,
    and the drafts verified per round."""
    length = max(positions) + 1
    res = dspark_jax.generate(target, [law.PROMPT] * n, max_new_tokens=length, temperature=1.0,
                              seed=0, drafter=drafter, verify=verify, verify_params=params)
    counters = sum_counters([r.stats["counters"] for r in res])
    return (*law.chi_square([[r.token_ids[i] for i in positions] for r in res],
                            law.marginal_law(target, positions)),
            counters["proposal_len_sum"] / counters["rounds"])


@pytest.fixture(scope="module")
def law_models():
    return law.law_models()


# Production's capacity comes from two rounds earlier, and from the prior of sure drafts in
# a request's first two rounds (round 0 emits tokens 1.., after the prefill's token 0). The flat
# verify of 20,000 rows runs 20,000 anchors + k drafts, at full speed up to 40,000 tokens and
# half speed beyond, so the capacity is about one draft per row, spread over the rows by
# current survival.
@pytest.mark.parametrize("verify,params,positions", [
    ("full", None, (0, 1, 2)), ("production", {"sps": [1.0] * 40001 + [0.5] * 40000}, (0, 1, 2, 3, 4))])
@pytest.mark.slow  # chi-square over 20,000 / 8,000 sequences; CI runs -m slow
def test_output_law_is_the_target_law(law_models, verify, params, positions):
    target, drafter = law_models
    chi2, dof, bound, verified = _law_chi2(target, drafter, 20000, verify, params, positions)
    assert chi2 < bound, (chi2, dof)
    assert verified > 0.3, verified  # drafts were verified


@pytest.mark.slow  # chi-square over 20,000 sequences; CI runs -m slow
def test_output_law_is_the_target_law_with_a_draft_vocabulary():
    """A drafter that may propose 9 of the 16 tokens: drafts are verified, and the emitted
    tokens still follow the target's law (the tokens it cannot propose come from the
    correction)."""
    target, drafter = law.law_models()
    drafter.restrict_vocab([0, 1, 3, 4, 6, 9, 10, 12, 15])
    chi2, dof, bound, verified = _law_chi2(target, drafter, 20000)
    assert chi2 < bound, (chi2, dof)
    assert verified > 0.3, verified


@pytest.mark.slow  # a chi-square law test over many sequences
def test_production_is_lossless_for_a_lone_request_with_token_dependent_confidence():
    """Appendix A: with c_2 depending on the drafted x_1, a capacity searched over the current
    block verifies x_1 only when x_1 is even, which biases t2. The production scheduler, run
    for each row alone, must size its capacity from two rounds earlier (a constant prior in
    rounds 0-1); chi2 was 336 (bound 152) when round 0 used its own confidences."""
    target, drafter = law.law_models(token_dependent_confidence=True)
    chi2, dof, bound, _ = _law_chi2(target, drafter, 4000, law.production_per_request,
                                 {"sps": law.ONE_REQUEST_SPS})
    assert chi2 < bound, (chi2, dof)


@pytest.mark.slow  # with the prefix policy's other checks
def test_prefix_scores_the_flat_verify_it_runs():
    """Rows with even anchors and drafts are certain (c = 1), the others hopeless (c = 0), and a
    forward above 8 tokens runs at half speed: the 4 rows' flat verify of 4 anchors + k drafts
    may carry at most 4 drafts, and Algorithm 1 gives the first certain row its whole block of
    3 (ties by request index), as the flat forward costs what it carries."""
    target, drafter = law.law_models(token_dependent_confidence=True)
    res = dspark_jax.generate(target, [law.PROMPT] * 4, max_new_tokens=24, temperature=1.0,
                              seed=1, drafter=drafter, verify="prefix",
                              verify_params={"sps": [1.0] * 9 + [0.5] * 8}, record=True)
    rounds = min(len(r.trace["proposal_len"]) for r in res)
    verified = np.stack([r.trace["proposal_len"][:rounds] for r in res])  # [4, rounds]
    assert (4 + verified.sum(axis=0)).max() <= 8, verified  # all four joined at once
    assert verified.max() >= 2, verified


def test_policy_sees_the_confidences_of_two_rounds_earlier(law_models):
    """The callable policy's ``lagged`` is round t-2's confidences, the prior (ones) in
    rounds 0-1."""
    target, drafter = law_models  # no EOS: the request runs all its rounds
    law.POLICY_CALLS.clear()
    res = dspark_jax.generate(target, [law.PROMPT], max_new_tokens=16, drafter=drafter,
                              temperature=1.0, verify=law.recording_policy, record=True)[0]
    conf = 1 / (1 + np.exp(-res.trace["confidence_logits"]))  # [rounds, P], temperatures 1
    calls = law.POLICY_CALLS[:len(conf)]
    assert len(conf) >= 4 and len(law.POLICY_CALLS) == len(conf)
    np.testing.assert_allclose(np.stack([c[0][0] for c in calls]), conf, rtol=1e-6)
    lagged = np.stack([c[1][0] for c in calls])
    np.testing.assert_array_equal(lagged[:2], round_lib.NO_HISTORY)
    np.testing.assert_allclose(lagged[2:], conf[:-2], rtol=1e-6)


@pytest.mark.slow  # chi-square over 20,000 / 8,000 sequences; CI runs -m slow
def test_broken_sampler_fails_the_law_test(law_models, monkeypatch):
    target, drafter = law_models
    monkeypatch.setattr(round_lib.rejection, "rejection_sample", _broken_rejection)
    engine.clear_compiled_programs()
    try:
        chi2, dof, bound, _ = _law_chi2(target, drafter, 8000)  # ~2x the bound at this size
    finally:
        engine.clear_compiled_programs()
    assert chi2 > bound, (chi2, dof)


def test_drafter_of_another_target_is_refused(qwen3):
    other = init_target(QWEN3, seed=9)
    drafter = dspark_jax.init_drafter(other)
    with pytest.raises(ValueError, match="another target"):
        dspark_jax.generate(qwen3, PROMPTS, max_new_tokens=4, drafter=drafter)


def test_unknown_policy_is_refused(qwen3):
    drafter = dspark_jax.init_drafter(qwen3)
    with pytest.raises(ValueError, match="unknown verification policy"):
        dspark_jax.generate(qwen3, PROMPTS, max_new_tokens=4, drafter=drafter, verify="sometimes")


def test_schedulers_without_a_table_say_so():
    from dspark_jax.scheduling import verification

    for policy in ("prefix", "production"):
        with pytest.warns(UserWarning, match=f"verify='{policy}' without a steps/s table"):
            verification.default_params(policy, 2, 7)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        verification.default_params("prefix", 2, 7, {"sps": [1.0] * 17})
        verification.default_params("full", 2, 7)
