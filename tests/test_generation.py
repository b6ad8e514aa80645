"""dspark_jax.generate on a tiny random target: batching, EOS, sampling, compiles, errors."""

import numpy as np
import pytest

import dspark_jax
from dspark_jax.prompts import prompt_bucket
from dspark_jax.target import init_target

TINY = dict(architectures=["LlamaForCausalLM"], vocab_size=48, hidden_size=32,
            intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, eos_token_id=3, max_position_embeddings=256)


@pytest.fixture(scope="module")
def target():
    return init_target(TINY, seed=1)


def greedy_reference(target, prompt, n):
    """Greedy decoding by repeated full forwards (no cache, no jit loop)."""
    ids = list(prompt)
    out = []
    for _ in range(n):
        nxt = int(target.logits(np.array([ids]))[0, -1].argmax())
        out.append(nxt)
        ids.append(nxt)
        if nxt in target.eos_token_ids:
            break
    return out


def test_greedy_matches_full_forward_reference(target):
    prompt = [5, 9, 11, 7]
    result = dspark_jax.generate(target, [prompt], max_new_tokens=12)[0]
    assert result.token_ids == greedy_reference(target, prompt, 12)


GEMMA3 = dict(TINY, architectures=["Gemma3ForCausalLM"], sliding_window=3,
              layer_types=["sliding_attention", "full_attention"])
# Full layers of their own shape: two stacks, a cache of two groups in the engine.
GEMMA4 = dict(GEMMA3, architectures=["Gemma4ForCausalLM"], global_head_dim=16,
              num_global_key_value_heads=1, attention_k_eq_v=True, hidden_size_per_layer_input=0,
              final_logit_softcapping=5.0, num_hidden_layers=3,
              layer_types=["sliding_attention", "full_attention", "full_attention"])


# Slow: the default run covers Gemma's sliding windows and two stacks by parity with
# transformers through the KV cache and by the engine's ragged forward (tests/models).
@pytest.mark.slow
@pytest.mark.parametrize("config", [GEMMA3, GEMMA4],
                         ids=["gemma3", "gemma4"])
def test_gemma_greedy_matches_full_forward_reference(config):
    """Sliding layers with a 3-token window through the engine's cache equal full forwards."""
    gemma = init_target(config, seed=2)
    prompts = [[5, 9, 11, 7, 30, 31], [17, 4]]
    results = dspark_jax.generate(gemma, prompts, max_new_tokens=12)
    assert [r.token_ids for r in results] == [greedy_reference(gemma, p, 12) for p in prompts]


def test_mixed_lengths_batch_equals_each_alone(target):
    prompts = [[5, 9], [4, 8, 15, 16, 23, 42, 7, 6, 10, 12, 14, 20, 21, 22, 30, 31, 32, 33], [17]]
    batched = dspark_jax.generate(target, prompts, max_new_tokens=10)
    for prompt, res in zip(prompts, batched):
        alone = dspark_jax.generate(target, [prompt], max_new_tokens=10)[0]
        assert res.token_ids == alone.token_ids
    # Two rows at a time: the third prompt joins when the first row finishes.
    joined = dspark_jax.generate(target, prompts, max_new_tokens=10, max_batch=2)
    assert [r.token_ids for r in joined] == [r.token_ids for r in batched]
    assert joined[0].stats["batch"] == 2


def test_eos_ends_each_row_and_is_included():
    # A zero LM head gives all-equal logits; greedy argmax then picks id 0, the EOS here.
    tgt = init_target(dict(TINY, tie_word_embeddings=False, eos_token_id=0), seed=3)
    tgt.state["lm_head"].set_value(tgt.state["lm_head"].get_value() * 0)
    result = dspark_jax.generate(tgt, [[5, 6, 7], [8]], max_new_tokens=8)
    for r in result:
        assert r.token_ids == [0]
        assert r.stats["new_tokens"] == 1
    assert result[0].stats["steps"] == 0


def test_max_new_tokens_respected(target):
    for n in (1, 2, 5):
        res = dspark_jax.generate(target, [[5, 9, 11]], max_new_tokens=n)[0]
        assert len(res.token_ids) <= n
        assert len(res.token_ids) == n or res.token_ids[-1] in target.eos_token_ids


def test_sampling_is_seeded_and_params_do_not_recompile(target):
    prompt = [[5, 9, 11]]
    a = dspark_jax.generate(target, prompt, max_new_tokens=8, temperature=1.0, seed=7)[0]
    b = dspark_jax.generate(target, prompt, max_new_tokens=8, temperature=1.0, seed=7)[0]
    assert a.token_ids == b.token_ids
    assert b.stats["compile_s"] == 0.0
    # Other temperature / top-p / top-k / seed: same compiled program.
    for kwargs in (dict(temperature=0.7, top_p=0.8), dict(temperature=1.3, top_k=5, seed=3)):
        res = dspark_jax.generate(target, prompt, max_new_tokens=8, **kwargs)[0]
        assert res.stats["compile_s"] == 0.0
    seeds = {tuple(dspark_jax.generate(target, prompt, max_new_tokens=8, temperature=1.0, seed=s)[0].token_ids)
             for s in range(6)}
    assert len(seeds) > 1


def test_seeded_prompts_sample_alike_in_any_batch_and_report_as_they_finish(target):
    """Per-prompt seeds: a prompt's sampled tokens do not depend on the prompts beside it, the
    rows or the engine's seed; on_finished sees every prompt once, with its index."""
    prompts = [[5, 9, 11], [7, 3], [2, 4, 6, 8], [9]]
    seeds = [11, 12, 13, 14]
    seen = {}
    kw = dict(max_new_tokens=6, temperature=1.0, top_k=12)
    together = dspark_jax.generate(target, prompts, seeds=seeds, max_batch=2, seed=1,
                                   on_finished=lambda i, tokens: seen.setdefault(i, tokens), **kw)
    assert seen == {i: r.token_ids for i, r in enumerate(together)}
    for i in (0, 3):
        alone = dspark_jax.generate(target, [prompts[i]], seeds=[seeds[i]], seed=2, **kw)[0]
        assert alone.token_ids == together[i].token_ids
    with pytest.raises(ValueError, match="2 seeds for 4 prompts"):
        dspark_jax.generate(target, prompts, seeds=seeds[:2], **kw)


def test_first_token_law_matches_target_distribution():
    """The first sampled token follows softmax(logits / T) (chi-square over 4000 draws)."""
    tgt = init_target(dict(TINY, vocab_size=8, eos_token_id=None), seed=4)
    prompt = [1, 2, 3]
    logits = tgt.logits(np.array([prompt]))[0, -1] / 0.8
    p = np.exp(logits - logits.max())
    p /= p.sum()
    draws = dspark_jax.generate(tgt, [prompt] * 4000, max_new_tokens=1, temperature=0.8, seed=11)
    counts = np.bincount([r.token_ids[0] for r in draws], minlength=8)
    expected = p * 4000
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 24.3  # 99.9% quantile of chi-square with 7 degrees of freedom


def test_prompt_buckets_bound_compiles(target):
    assert prompt_bucket(1) == 16
    assert prompt_bucket(16) == 16
    assert prompt_bucket(17) == 32
    assert [prompt_bucket(n) for n in (1024, 1025, 2049, 4100)] == [
        1024, 2048, 3072, 5120]  # past 1024: multiples of 1024
    dspark_jax.generate(target, [[1] * 3], max_new_tokens=4)
    res = dspark_jax.generate(target, [[1] * 9], max_new_tokens=4)[0]
    assert res.stats["compile_s"] == 0.0  # same bucket (16), same program


@pytest.mark.slow  # query-chunked attention: tests/models/test_attention.py
def test_long_prompt_in_a_multiple_of_1024_matches_the_reference():
    """A 2,100-token prompt pads to 3,072 (not 4,096) and prefills in query chunks of 512."""
    long = init_target(dict(TINY, max_position_embeddings=4096), seed=1)
    prompt = [int(t) for t in np.random.default_rng(0).integers(4, 48, 2100)]
    assert prompt_bucket(len(prompt)) == 3072
    result = dspark_jax.generate(long, [prompt], max_new_tokens=4)[0]
    assert result.token_ids == greedy_reference(long, prompt, 4)


@pytest.mark.parametrize("prompts,match", [
    ([[]], "prompt 0 is empty"),
    ([[1, 2], []], "prompt 1 is empty"),
    ([], "no prompts"),
    ([[1, 2, 99]], "outside the vocabulary"),
])
def test_bad_prompts(target, prompts, match):
    with pytest.raises(ValueError, match=match):
        dspark_jax.generate(target, prompts, max_new_tokens=4)


def test_strings_need_a_tokenizer(target):
    with pytest.raises(ValueError, match="no tokenizer"):
        dspark_jax.generate(target, ["hello"], max_new_tokens=4)
