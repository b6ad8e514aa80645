"""Tests of the block sampler and the sequential heads it drives."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import dspark_jax
from dspark_jax.decoding.block_sampler import (DraftVocab, full_vocab_probs, sample_block,
                                              sample_draft)
from dspark_jax.decoding.sampling import sample
from dspark_jax.models.heads import ConfidenceHead, RNNHead, make_head
from dspark_jax.target import init_target

V, D, R, B, P = 24, 16, 8, 2, 5


def _inputs(seed=0):
    k1, k2, k3 = jax.random.split(jax.random.key(seed), 3)
    hidden = jax.random.normal(k1, (B, P, D))
    base = 2.0 * jax.random.normal(k2, (B, P, V))
    anchor = jax.random.randint(k3, (B,), 0, V)
    return hidden, base, anchor


def _heads(kind):
    head = make_head(kind, vocab=V, rank=R, hidden_size=D, dtype=jnp.float32, rngs=nnx.Rngs(1))
    if head is not None:  # larger weights than the 0.02 init, so the bias matters
        head.markov_w2.kernel.set_value(head.markov_w2.kernel.get_value() * 100.0)
    conf = ConfidenceHead(hidden_size=D, rank=R if head is not None else 0, dtype=jnp.float32,
                          rngs=nnx.Rngs(2))
    return head, conf


def _python_loop(head, conf, hidden, base, anchor, key, temperature, top_p):
    state = None if head is None else head.init_state((B,))
    prev, tokens, probs, confidence = anchor, [], [], []
    for k in range(P):
        logits = base[:, k]
        if head is not None:
            state, bias = head.step(state, prev, hidden[:, k])
            logits = logits + bias
        tok, q = sample(jax.random.fold_in(key, k), logits, temperature, top_p)
        confidence.append(conf(hidden[:, k], None if head is None else head.prev_embedding(prev)))
        tokens.append(tok)
        probs.append(q)
        prev = tok
    return np.stack(tokens, 1), np.stack(probs, 1), np.stack(confidence, 1)


@pytest.mark.parametrize("kind", ["markov", "gated", "rnn", "none"])
@pytest.mark.parametrize("temperature,top_p", [(0.0, 1.0), (0.8, 0.9)])
def test_scan_equals_python_loop(kind, temperature, top_p):
    head, conf = _heads(kind)
    hidden, base, anchor = _inputs()
    key = jax.random.key(7)
    out = sample_block(head=head, confidence_head=conf, confidence_with_markov=head is not None,
                       hidden=hidden, base_logits=base, anchor_tokens=anchor, key=key,
                       temperature=temperature, top_p=top_p)
    tokens, probs, confidence = _python_loop(head, conf, hidden, base, anchor, key, temperature, top_p)
    np.testing.assert_array_equal(out.tokens, tokens)
    np.testing.assert_allclose(out.probs, probs, atol=1e-6)
    np.testing.assert_allclose(out.confidence, confidence, atol=1e-6)
    np.testing.assert_allclose(np.asarray(out.probs).sum(-1), 1.0, atol=1e-5)
    picked = np.take_along_axis(np.asarray(out.probs), np.asarray(out.tokens)[..., None], -1)
    assert (picked > 0).all()


def test_zero_w2_is_dflash():
    head, _ = _heads("markov")
    head.markov_w2.kernel.set_value(jnp.zeros_like(head.markov_w2.kernel.get_value()))
    hidden, base, anchor = _inputs(1)
    kwargs = dict(confidence_head=None, confidence_with_markov=False, hidden=hidden,
                  base_logits=base, anchor_tokens=anchor, key=jax.random.key(3), temperature=1.0)
    with_head = sample_block(head=head, **kwargs)
    without = sample_block(head=None, **kwargs)
    np.testing.assert_array_equal(with_head.tokens, without.tokens)
    np.testing.assert_allclose(with_head.probs, without.probs, atol=1e-7)
    assert with_head.confidence is None


def test_markov_bias_chain_under_greedy():
    # Rank V with W1 = I: the head is an exact successor table, prev -> prev + 1 (mod V).
    head = make_head("markov", vocab=V, rank=V, hidden_size=D, dtype=jnp.float32, rngs=nnx.Rngs(0))
    head.markov_w1.embedding.set_value(jnp.eye(V))
    head.markov_w2.kernel.set_value(10.0 * jnp.roll(jnp.eye(V), 1, axis=1))
    hidden, base, _ = _inputs(2)
    anchor = jnp.array([3, 20])
    out = sample_block(head=head, confidence_head=None, confidence_with_markov=False,
                       hidden=hidden, base_logits=0.1 * base, anchor_tokens=anchor,
                       key=jax.random.key(0), temperature=0.0)
    np.testing.assert_array_equal(out.tokens, [[4, 5, 6, 7, 8], [21, 22, 23, 0, 1]])
    np.testing.assert_array_equal(np.asarray(out.probs).max(-1), 1.0)  # greedy point masses


def test_rnn_head_step_matches_equation_6():
    head, _ = _heads("rnn")
    assert isinstance(head, RNNHead)
    hidden, _, anchor = _inputs(3)
    s0 = head.init_state((B,))
    np.testing.assert_array_equal(s0, np.zeros((B, R)))
    state, bias = head.step(s0, anchor, hidden[:, 0])
    w1 = np.asarray(head.markov_w1.embedding.get_value())
    z = np.concatenate([np.zeros((B, R)), w1[np.asarray(anchor)], np.asarray(hidden[:, 0])], -1)
    joint = (z @ np.asarray(head.joint_proj.kernel.get_value())
             + np.asarray(head.joint_proj.bias.get_value()))
    g, c, o = np.split(joint, 3, -1)
    gate = 1 / (1 + np.exp(-g))
    np.testing.assert_allclose(state, (1 - gate) * np.tanh(c), atol=1e-5)
    w2 = np.asarray(head.markov_w2.kernel.get_value())
    np.testing.assert_allclose(bias, np.tanh(o) @ w2, atol=1e-4)


def test_sampling_parameters_do_not_recompile():
    head, conf = _heads("gated")
    hidden, base, anchor = _inputs(4)
    traces = []

    @jax.jit
    def run(key, temperature, top_p):
        traces.append(1)
        return sample_block(head=head, confidence_head=conf, confidence_with_markov=True,
                            hidden=hidden, base_logits=base, anchor_tokens=anchor, key=key,
                            temperature=temperature, top_p=top_p)

    results = [run(jax.random.key(i), jnp.float32(t), jnp.float32(p))
               for i, (t, p) in enumerate([(0.0, 1.0), (0.7, 0.9), (1.3, 0.5), (1.0, 1.0)])]
    assert len(traces) == 1 and run._cache_size() == 1
    assert not np.array_equal(results[0].probs, results[1].probs)


def test_sample_draft_proposal_slots():
    target = init_target(dict(architectures=["Qwen3ForCausalLM"], vocab_size=64, hidden_size=32,
                              intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
                              num_key_value_heads=2, head_dim=8))
    hidden = jax.random.normal(jax.random.key(0), (2, 5, 32))
    for anchor_predicts, count in ((True, 5), (False, 4)):
        drafter = dspark_jax.init_drafter(target, block_size=5, markov_rank=4,
                                          anchor_predicts=anchor_predicts)
        out = jax.jit(lambda m, t: sample_draft(m, t, hidden=hidden, anchor_tokens=jnp.array([1, 2]),
                                                key=jax.random.key(1), temperature=0.0))(
            drafter.model, target.model)
        assert out.tokens.shape == (2, count) and out.probs.shape == (2, count, 64)
        assert out.confidence.shape == (2, count)


@pytest.mark.parametrize("kind", ["markov", "rnn", "none"])
@pytest.mark.parametrize("temperature,top_p", [(0.0, 1.0), (0.8, 0.9)])
def test_a_draft_vocabulary_samples_the_law_restricted_to_it(kind, temperature, top_p):
    """Over a draft vocabulary of V' tokens the sampler draws from the full sampler's law with
    every other token's logit at -inf: the same tokens, and probability rows that are zero off
    the V' (the head's bias taken at those tokens only)."""
    head, conf = _heads(kind)
    hidden, base, anchor = _inputs(3)
    vocab = jnp.asarray([0, 2, 3, 5, 8, 11, 13, 17, 19, 23], jnp.int32)
    anchor = vocab[anchor % vocab.size]
    masked = jnp.full_like(base, -jnp.inf).at[..., vocab].set(base[..., vocab])
    common = dict(head=head, confidence_head=conf, confidence_with_markov=head is not None,
                  hidden=hidden, anchor_tokens=anchor, key=jax.random.key(4),
                  temperature=temperature, top_p=top_p)
    full = sample_block(base_logits=masked, **common)
    draft_vocab = DraftVocab(vocab, None, None if head is None else head.columns(vocab))
    restricted = sample_block(base_logits=base[..., vocab], draft_vocab=draft_vocab, **common)
    np.testing.assert_array_equal(restricted.tokens, full.tokens)
    assert np.isin(np.asarray(restricted.tokens), np.asarray(vocab)).all()
    assert restricted.probs.shape == (B, P, vocab.size)  # the V' columns only
    widened = full_vocab_probs(restricted.probs, draft_vocab, V)
    np.testing.assert_allclose(widened, full.probs, atol=1e-6)
    off = np.ones(V, bool)
    off[np.asarray(vocab)] = False
    assert not np.asarray(widened)[..., off].any()
    if conf is not None:
        np.testing.assert_allclose(restricted.confidence, full.confidence, rtol=1e-6)
