"""The engine's output law is the target's, with the production scheduler cutting budgets across
requests (chi-square on the first three tokens of 20,000 requests over a 16-token vocabulary)."""

import itertools

import numpy as np
import pytest

import dspark_jax
from dspark_jax.serving import Engine
from dspark_jax.target import init_target

QWEN3 = dict(architectures=["Qwen3ForCausalLM"], vocab_size=16, hidden_size=32, intermediate_size=64,
             num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
             eos_token_id=None, max_position_embeddings=512)
PROMPT = [1, 2, 3]


@pytest.fixture(scope="module")
def law_models():
    target = init_target(QWEN3, seed=7)
    # A larger LM head makes the target (and the drafter, which shares it) far from uniform,
    # and the two disagree, so a wrong acceptance rule visibly changes the output law.
    target.state["lm_head"].set_value(target.state["lm_head"].get_value() * 25)
    return target, dspark_jax.init_drafter(target, seed=8, block_size=3)


def exact_law(target) -> np.ndarray:
    """p(t1) p(t2 | t1) p(t3 | t1, t2) [V, V, V] from the target's logits over every prefix."""
    vocab = target.config.vocab_size
    prefixes = np.array([PROMPT + list(p) for p in itertools.product(range(vocab), repeat=2)])
    logits = target.logits(prefixes)
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    n = len(PROMPT)
    first = probs[0, n - 1]
    second = probs[:, n].reshape(vocab, vocab, vocab)[:, 0, :]
    third = probs[:, n + 1].reshape(vocab, vocab, vocab)
    return first[:, None, None] * second[:, :, None] * third


def test_production_scheduler_is_lossless(law_models):
    target, drafter = law_models
    slots, n = 128, 20000
    # Step-shaped steps/s over forward tokens 1..512: the capacity lands inside the batch, so the
    # budget is cut across requests by their current confidences.
    sps = [1.0] * 161 + [0.8] * 100 + [0.45] * 252
    engine = Engine(target, drafter, slots=slots, max_len=8, policy="production",
                    policy_params={"sps": sps}, buckets=(128, 256), seed=3)
    requests = [engine.submit(PROMPT, max_new_tokens=3, temperature=1.0) for _ in range(n)]
    engine.run()
    budgets = sum(r.proposed for r in requests) / sum(r.rounds for r in requests)
    assert 0.3 < budgets < 2.7, budgets  # neither nothing nor everything was verified
    vocab = target.config.vocab_size
    counts = np.zeros((vocab,) * 3)
    for r in requests:
        counts[tuple(r.tokens)] += 1
    expected = exact_law(target) * n
    big = expected >= 5
    chi2 = float(((counts[big] - expected[big]) ** 2 / expected[big]).sum())
    rest_obs, rest_exp = counts[~big].sum(), expected[~big].sum()
    chi2 += (rest_obs - rest_exp) ** 2 / rest_exp if rest_exp > 0 else 0.0
    dof = int(big.sum()) + (rest_exp > 0) - 1
    # 99.9% quantile of chi-square ~ dof + 3.09 sqrt(2 dof) + (2/3)(3.09^2 - 1) for large dof.
    assert chi2 < dof + 3.09 * np.sqrt(2 * dof) + 6, (chi2, dof)
