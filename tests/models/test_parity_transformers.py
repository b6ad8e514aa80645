"""Logit parity of the JAX decoder with transformers' PyTorch Llama / Qwen2 / Qwen3 / Gemma3 /
Gemma4 (float32).

Each case is a small random checkpoint written by transformers' ``save_pretrained`` and read with
``dspark_jax.load_target``; it covers GQA and MHA, odd head counts, explicit head_dim, tied and
untied embeddings, q/k/v(/o) biases, the rope scaling types default, linear, llama3 and yarn, and
Gemma3's sliding-window layers (windows shorter than the prompts, their own rope),
query_pre_attn_scalar and final-logit soft-capping, and Gemma4's full-attention layers of
their own shape (global head dim and kv heads, keys as values, proportional partial rope) next
to its sliding ones, value norms and per-layer scalars.
The comparisons run the full forward (right padding), the KV-cache path (prefill, rejected
draft, multi-token verification, token-by-token decoding) and the layer taps.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import dspark_jax  # noqa: E402
from dspark_jax.model_config import attention_dims  # noqa: E402
from dspark_jax.models.kv_cache import KVCache  # noqa: E402

TOL = 1e-4
VOCAB = 128
LENGTHS = (19, 11, 24)  # real prompt lengths of the batch (right padded to 24)
PREFILL = (9, 3, 14)  # per-row prefill lengths for the cache test (each <= length - 8)
PAD = 0


def _llama(**kw):
    base = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, max_position_embeddings=256,
                bos_token_id=1, eos_token_id=2, pad_token_id=PAD)
    return transformers.LlamaConfig(**{**base, **kw})


def _qwen2(**kw):
    base = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, max_position_embeddings=256,
                bos_token_id=1, eos_token_id=2, pad_token_id=PAD)
    return transformers.Qwen2Config(**{**base, **kw})


def _qwen3(**kw):
    base = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, max_position_embeddings=256,
                bos_token_id=1, eos_token_id=2, pad_token_id=PAD)
    return transformers.Qwen3Config(**{**base, **kw})


def _gemma3(**kw):
    base = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, max_position_embeddings=256,
                bos_token_id=1, eos_token_id=2, pad_token_id=PAD)
    return transformers.Gemma3TextConfig(**{**base, **kw})


def _gemma4(**kw):
    base = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, max_position_embeddings=256,
                bos_token_id=1, eos_token_id=2, pad_token_id=PAD, hidden_size_per_layer_input=0)
    return transformers.Gemma4TextConfig(**{**base, **kw})


CASES = {
    # GQA 4/2, untied, default rope.
    "llama-default-gqa": lambda: _llama(num_hidden_layers=2, num_attention_heads=4,
                                        num_key_value_heads=2, tie_word_embeddings=False),
    # Odd head count 5 (LlamaConfig wants hidden % heads == 0: hidden 80, head_dim 16), one kv
    # head, q/k/v/o and MLP biases, Llama 3 rope scaling with a short original context so that
    # the scaling matters, tied.
    "llama-llama3-odd-bias-tied": lambda: _llama(
        hidden_size=80, num_hidden_layers=3, num_attention_heads=5, num_key_value_heads=1, attention_bias=True,
        mlp_bias=True, tie_word_embeddings=True,
        rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                          original_max_position_embeddings=16),
        rope_theta=500000.0),
    # MHA, linear rope scaling.
    "llama-linear-mha": lambda: _llama(
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=False,
        rope_scaling=dict(rope_type="linear", factor=3.0)),
    # Qwen2 (q/k/v bias), GQA, yarn, tied.
    "qwen2-yarn-tied": lambda: _qwen2(
        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
        rope_scaling=dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=16)),
    # Qwen2, odd head count 5 with one kv head (head_dim 64 // 5 = 12, 5 * 12 != hidden),
    # default rope, untied.
    "qwen2-default-odd": lambda: _qwen2(
        num_hidden_layers=2, num_attention_heads=5, num_key_value_heads=1, tie_word_embeddings=False),
    # Qwen3 (q/k norm), explicit head_dim 16 != 64/3, odd head count 3 with one kv head, yarn.
    "qwen3-yarn-odd-headdim": lambda: _qwen3(
        num_hidden_layers=2, num_attention_heads=3, num_key_value_heads=1, head_dim=16,
        tie_word_embeddings=False,
        rope_scaling=dict(rope_type="yarn", factor=2.0, original_max_position_embeddings=8,
                          beta_fast=16.0, beta_slow=2.0)),
    # Qwen3 with attention_bias (q/k/v/o bias), head_dim 32, tied, default rope.
    "qwen3-default-bias-tied": lambda: _qwen3(
        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
        attention_bias=True, tie_word_embeddings=True),
    # Gemma3: sliding / full / sliding layers with a 5-token window (shorter than every prompt),
    # GQA 4/2, head_dim 16, query_pre_attn_scalar 24, linear rope scaling on the full layer and
    # the default local rope on the sliding ones, final logits soft-capped at 3, tied.
    "gemma3-sliding-softcap": lambda: _gemma3(
        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        query_pre_attn_scalar=24, sliding_window=5, final_logit_softcapping=3.0,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        rope_scaling=dict(rope_type="linear", factor=2.0)),
    # Gemma3: the sliding_window_pattern of older configs (every second layer full), MHA,
    # head_dim 32 (q/k norms of another size), a 7-token window, untied.
    "gemma3-pattern-mha-untied": lambda: _gemma3(
        num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=2, head_dim=32,
        query_pre_attn_scalar=32, sliding_window=7, sliding_window_pattern=2,
        tie_word_embeddings=False),
    # Gemma4: sliding / full / sliding / sliding / full, so the two stacks interleave in runs of
    # 1, 1, 2, 1; sliding layers GQA 4/2 with head_dim 16, full layers one kv head of 32 whose
    # keys are also the values (attention_k_eq_v), proportional rope over a quarter of the
    # full head; a 5-token window; logits soft-capped at 3; tied.
    "gemma4-global-keqv": lambda: _gemma4(
        num_hidden_layers=5, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        global_head_dim=32, num_global_key_value_heads=1, attention_k_eq_v=True, sliding_window=5,
        final_logit_softcapping=3.0,
        layer_types=["sliding_attention", "full_attention", "sliding_attention",
                     "sliding_attention", "full_attention"]),
    # Gemma4 with one shape for both layer types (global_head_dim = head_dim, own values): one
    # stack, the layers picking their rope and window; half the full head rotates, a 7-token
    # window, untied.
    "gemma4-one-stack-untied": lambda: _gemma4(
        num_hidden_layers=3, num_attention_heads=2, num_key_value_heads=2, head_dim=32,
        global_head_dim=32, sliding_window=7, tie_word_embeddings=False,
        layer_types=["sliding_attention", "full_attention", "full_attention"],
        rope_parameters={"full_attention": dict(rope_type="proportional", partial_rotary_factor=0.5,
                                                rope_theta=50_000.0),
                         "sliding_attention": dict(rope_type="default", rope_theta=5_000.0)}),
}


def _batch(seed: int = 1):
    rng = np.random.default_rng(seed)
    width = max(LENGTHS)
    ids = np.full((len(LENGTHS), width), PAD, np.int64)
    mask = np.zeros(ids.shape, np.int64)
    for i, n in enumerate(LENGTHS):
        ids[i, :n] = rng.integers(3, VOCAB, n)
        mask[i, :n] = 1
    return ids, mask


@pytest.fixture(scope="module", params=sorted(CASES))
def case(request, tmp_path_factory, make_hf_checkpoint):
    """(torch model, loaded Target, ids, mask, torch outputs) of one config."""
    config = CASES[request.param]()
    folder = tmp_path_factory.mktemp("parity") / request.param
    model = make_hf_checkpoint(config, folder, seed=len(request.param))
    target = dspark_jax.load_target(folder)
    ids, mask = _batch()
    with torch.no_grad():
        out = model(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask),
                    output_hidden_states=True)
    ref_logits = out.logits.float().numpy()
    ref_hidden = [h.float().numpy() for h in out.hidden_states]
    return model, target, ids, mask, ref_logits, ref_hidden


def _max_diff_real(a, b, mask):
    real = np.asarray(mask, bool)
    return float(np.max(np.abs(a[real] - b[real])))


def test_config_matches_transformers(case):
    model, target, *_ = case
    tc, c = model.config, target.config
    assert c.num_attention_heads == tc.num_attention_heads
    per_layer = getattr(tc, "per_layer_config", None)  # Gemma4: each layer's own shape
    for i, layer_type in enumerate(c.layer_types):
        ltc = tc if per_layer is None else per_layer[i]
        kv_heads, head_dim, _ = attention_dims(c, layer_type)
        assert kv_heads == ltc.num_key_value_heads
        assert head_dim == (getattr(ltc, "head_dim", None) or tc.hidden_size // tc.num_attention_heads)
    assert c.tie_word_embeddings == tc.tie_word_embeddings
    rope = getattr(tc, "rope_parameters", None) or getattr(tc, "rope_scaling", None) or {}
    rope = rope.get("full_attention", rope)  # Gemma3: one rope per layer type
    assert c.rope_scaling["rope_type"] == rope.get("rope_type", rope.get("type", "default"))
    assert c.layer_types == tuple(getattr(tc, "layer_types", None) or c.layer_types)
    if "sliding_attention" in c.layer_types:
        assert c.sliding_window == tc.sliding_window < min(LENGTHS)
    # The lm_head really is separate when untied (and absent when tied).
    assert (target.model.lm_head is None) == bool(tc.tie_word_embeddings)


def test_logits_match_transformers(case):
    _, target, ids, mask, ref_logits, _ = case
    logits = target.logits(ids, mask)
    assert logits.shape == ref_logits.shape
    assert logits.dtype == np.float32
    assert np.abs(ref_logits).max() > 0.5  # the random model is not trivially flat
    assert _max_diff_real(logits, ref_logits, mask) <= TOL


@functools.partial(jax.jit, static_argnums=0)
def _cached_step(graphdef, state, tokens, positions, cache):
    model = nnx.merge(graphdef, state)
    out = model(tokens, positions, cache=cache)
    return model.logits(out.hidden), out.cache


def test_kv_cache_matches_full_forward(case):
    """Prefill (with garbage in the padded slots), a rejected 3-token draft, a 3-token
    verification, then token-by-token decoding, each row at its own positions."""
    _, target, ids, mask, ref_logits, _ = case
    full = target.logits(ids, mask)
    cfg = target.config
    batch, width = ids.shape
    rows = np.arange(batch)[:, None]
    prefill = np.asarray(PREFILL)
    rng = np.random.default_rng(7)

    cache = KVCache.for_model(cfg, batch, width, jnp.float32)
    p_max = int(prefill.max())
    tokens = ids[:, :p_max].copy()
    for i, p in enumerate(prefill):  # right padding filled with garbage tokens
        tokens[i, p:] = rng.integers(3, VOCAB, p_max - p)
    positions = np.broadcast_to(np.arange(p_max), tokens.shape)
    logits, cache = _cached_step(target.graphdef, target.state, jnp.asarray(tokens, jnp.int32),
                                 jnp.asarray(positions, jnp.int32), cache)
    logits = np.asarray(logits)
    for i, p in enumerate(prefill):
        np.testing.assert_allclose(logits[i, :p], ref_logits[i, :p], atol=TOL, rtol=0)

    checked = []

    def extend(offsets, tokens_fn, compare):
        nonlocal cache
        pos = prefill[:, None] + np.asarray(offsets)[None, :]
        toks = tokens_fn(pos)
        out, cache = _cached_step(target.graphdef, target.state, jnp.asarray(toks, jnp.int32),
                                  jnp.asarray(pos, jnp.int32), cache)
        out = np.asarray(out)
        for j in compare:
            got, ref, alt = out[:, j], ref_logits[rows[:, 0], pos[:, j]], full[rows[:, 0], pos[:, j]]
            assert np.max(np.abs(got - ref)) <= TOL, (offsets, j)
            assert np.max(np.abs(got - alt)) <= TOL, (offsets, j)
            checked.append(pos[:, j])

    # A draft of 3 tokens whose last two are wrong: only the first position is valid.
    def wrong_draft(pos):
        toks = ids[rows, pos].copy()
        toks[:, 1:] = (toks[:, 1:] + 1 + rng.integers(0, VOCAB - 4, toks[:, 1:].shape)) % VOCAB
        assert np.all(toks[:, 1:] != ids[rows, pos][:, 1:])
        return toks

    extend([0, 1, 2], wrong_draft, compare=[0])
    # Verification of the next 3 true tokens overwrites the stale slots of the rejected draft.
    extend([1, 2, 3], lambda pos: ids[rows, pos], compare=[0, 1, 2])
    for step in range(4, 8):  # then plain decoding, one token per row
        extend([step], lambda pos: ids[rows, pos], compare=[0])
    assert len(checked) == 1 + 3 + 4


@functools.partial(jax.jit, static_argnums=(0, 4))
def _taps(graphdef, state, tokens, key_valid, tap_ids):
    model = nnx.merge(graphdef, state)
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
    out = model(tokens, positions, key_valid=key_valid, tap_layer_ids=tap_ids)
    return out.hidden, out.taps


def test_taps_are_raw_layer_outputs(case):
    _, target, ids, mask, _, ref_hidden = case
    num_layers = target.config.num_hidden_layers
    d = target.config.hidden_size
    tap_ids = (-1, 0, num_layers - 2)  # for 2 layers the last two coincide
    hidden, taps = _taps(target.graphdef, target.state, jnp.asarray(ids, jnp.int32),
                         jnp.asarray(mask, bool), tap_ids)
    hidden, taps = np.asarray(hidden), np.asarray(taps)
    assert taps.shape == ids.shape + (len(tap_ids) * d,)
    for slot, layer in enumerate(tap_ids):
        ref = ref_hidden[layer + 1]
        got = taps[..., slot * d:(slot + 1) * d]
        assert np.abs(ref[np.asarray(mask, bool)]).max() > 0.1
        assert _max_diff_real(got, ref, mask) <= TOL, (slot, layer)
    # torch's last hidden state is the output of the final norm.
    assert _max_diff_real(hidden, ref_hidden[num_layers], mask) <= TOL


def test_taps_reject_out_of_range_layer(case):
    _, target, ids, mask, _, _ = case
    with pytest.raises(ValueError, match="out of range"):
        _taps(target.graphdef, target.state, jnp.asarray(ids, jnp.int32), jnp.asarray(mask, bool),
              (target.config.num_hidden_layers,))
