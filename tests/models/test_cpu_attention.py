"""``models.cpu_attention``: the attention over one layer of a stacked float32 cache on x86
CPUs equals the einsum's (``layers.attend_cached``) to float32 rounding, reads only each row's
committed slots, gives a token in a verify the bits it gets in a decode step, stays out of
programs it does not apply to, names bad input, and is what the engine's programs attend
with, greedy speculative decoding equal to greedy autoregressive decoding through it. The
prefill's attention within rows (``attend_rows``) equals the einsum's causal attention, with
and without a window, and gives each prompt token the bits of its decode step."""

import functools
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dspark_jax
from dspark_jax import engine
from dspark_jax.models import cpu_attention, fused_attention, layers
from dspark_jax.target import init_target

pytestmark = pytest.mark.skipif(not cpu_attention.available(),
                                reason="no cpu_attention kernel here")


def _operands(layers_, rows, tokens, heads, kv_heads, head_dim, slots, seed=0):
    rng = np.random.default_rng(seed)
    f = lambda *shape: rng.standard_normal(shape).astype(np.float32)  # noqa: E731
    return dict(q=f(rows, tokens, heads, head_dim),
                k_cache=f(layers_, rows, kv_heads, head_dim, slots),
                v_cache=f(layers_, rows, kv_heads, slots, head_dim),
                k_new=f(rows, tokens, kv_heads, head_dim), v_new=f(rows, tokens, kv_heads, head_dim))


@functools.cache
def _jitted(kernel, **static):
    return jax.jit(functools.partial(kernel, **static))


def _kernel(x, layer, lengths, new_visible, scale):
    return np.asarray(_jitted(cpu_attention._kernel, scale=scale)(
        x["q"], x["k_cache"], x["v_cache"], layer, lengths, x["k_new"], x["v_new"], new_visible))


def _einsum(x, layer, lengths, new_visible, scale):
    slots = x["v_cache"].shape[3]
    committed = np.arange(slots)[None, None, :] < np.asarray(lengths)[:, None, None]
    committed = np.broadcast_to(committed, x["q"].shape[:2] + (slots,))
    return np.asarray(layers.attend_cached(
        x["q"], x["k_cache"][layer], x["v_cache"][layer], committed, x["k_new"], x["v_new"],
        new_visible, scale=scale))


# (layers, rows, tokens, heads, kv heads, head dim, slots): SmolLM2's heads (9 over 3, 64),
# 4 heads of 128 over one kv head (values 3 heads at a time), 10 over one (blocks of 4, 4, 2),
# 16-wide heads, a slot count off the 64-slot passes.
SHAPES = [(3, 2, 5, 9, 3, 64, 100), (2, 1, 1, 4, 1, 128, 70), (1, 2, 3, 10, 1, 32, 40),
          (1, 3, 8, 2, 2, 16, 257)]


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_it_is_the_einsums_attention_over_the_committed_slots(shape):
    x = _operands(*shape)
    num_layers, rows, tokens = shape[:3]
    slots = shape[-1]
    lengths = np.array([slots - 3, 0, slots + 5][:rows], np.int32)  # a full, an empty, a clipped row
    visible = np.broadcast_to(np.tril(np.ones((tokens, tokens), bool)), (rows, tokens, tokens)).copy()
    visible[-1, :, tokens // 2:] = False  # a row whose last tokens are padding
    for layer in range(num_layers):
        got = _kernel(x, layer, lengths, visible, 0.125)
        want = _einsum(x, layer, np.minimum(lengths, slots), visible, 0.125)
        assert got.shape == x["q"].shape and got.dtype == np.float32
        np.testing.assert_allclose(got, want, rtol=0, atol=2e-6)


def test_a_query_that_sees_nothing_gets_zeros():
    x = _operands(1, 1, 2, 2, 1, 16, 8)
    visible = np.array([[[False, False], [True, True]]])
    got = _kernel(x, 0, np.array([0], np.int32), visible, 0.25)
    np.testing.assert_array_equal(got[0, 0], 0.0)
    np.testing.assert_allclose(got[0, 1], _einsum(x, 0, [0], visible, 0.25)[0, 1], atol=2e-6)


def test_a_verified_token_gets_the_bits_of_its_decode_step():
    num_layers, rows, tokens, heads, kv_heads, head_dim, slots = 2, 2, 6, 6, 2, 64, 90
    x = _operands(num_layers, rows, tokens, heads, kv_heads, head_dim, slots, seed=3)
    start = np.array([37, 5], np.int32)
    causal = np.broadcast_to(np.tril(np.ones((tokens, tokens), bool)), (rows, tokens, tokens))
    verify = _kernel(x, 1, start, causal, 0.125)
    one = dict(x)
    one["k_cache"], one["v_cache"] = x["k_cache"].copy(), x["v_cache"].copy()
    for t in range(tokens):  # the decode step of token t, tokens before it committed
        step = {k: v[:, t:t + 1] if k in ("q", "k_new", "v_new") else v for k, v in one.items()}
        got = _kernel(step, 1, start + t, np.ones((rows, 1, 1), bool), 0.125)
        np.testing.assert_array_equal(got[:, 0], verify[:, t])
        for b in range(rows):
            one["k_cache"][1, b, :, :, start[b] + t] = x["k_new"][b, t]
            one["v_cache"][1, b, :, start[b] + t] = x["v_new"][b, t]


def _row_kernel(q, k, v, lengths, scale, window=None):
    return np.asarray(_jitted(cpu_attention._row_kernel, scale=scale, window=window or 0)(
        q, k, v, np.asarray(lengths, np.int32)))


def _row_operands(rows, tokens, heads, kv_heads, head_dim, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal((rows, tokens, h, head_dim)).astype(np.float32)
            for h in (heads, kv_heads, kv_heads)]


# (rows, tokens, heads, kv heads, head dim, window): SmolLM2's heads over two 64-token blocks
# and a partial one; 16 query heads per kv head (more than one scoring pass); 128-wide heads
# with a window (the later blocks lay out only the keys their window reaches); a row shorter
# than a block.
ROW_SHAPES = [(3, 150, 9, 3, 64, None), (2, 70, 16, 1, 16, None), (2, 140, 4, 2, 128, 37),
              (1, 5, 2, 2, 32, None)]


@pytest.mark.parametrize("shape", ROW_SHAPES, ids=str)
def test_a_prefill_is_the_einsums_causal_attention_within_each_row(shape):
    *dims, window = shape
    q, k, v = _row_operands(*dims)
    rows, tokens = dims[:2]
    lengths = np.array([tokens, 0, tokens - 13][:rows])  # a full row, an empty one, padding
    got = _row_kernel(q, k, v, lengths, 0.125, window)
    segments = (np.arange(tokens)[None] < lengths[:, None]).astype(np.int32)
    want = layers.attend(q, k, v, fused_attention.segment_mask(jnp.asarray(segments), window),
                         scale=0.125)
    assert got.shape == q.shape and got.dtype == np.float32
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-6)
    if rows > 1:  # the empty row: zeros
        np.testing.assert_array_equal(got[1], 0.0)


@pytest.mark.parametrize("heads,kv_heads,head_dim", [(6, 2, 64), (16, 1, 128)], ids=str)
def test_a_prefilled_token_gets_the_bits_of_its_decode_step(heads, kv_heads, head_dim):
    rows, tokens = 2, 70
    q, k, v = _row_operands(rows, tokens, heads, kv_heads, head_dim, seed=5)
    lengths = np.array([tokens + 9, 41])  # a length past the row is the whole row
    prefill = _row_kernel(q, k, v, lengths, 0.125)
    cache = dict(k_cache=np.zeros((1, rows, kv_heads, head_dim, tokens), np.float32),
                 v_cache=np.zeros((1, rows, kv_heads, tokens, head_dim), np.float32))
    cache["k_cache"][0] = k.transpose(0, 2, 3, 1)
    cache["v_cache"][0] = v.transpose(0, 2, 1, 3)
    for t in range(tokens):  # the decode step of token t over the tokens before it, committed
        step = dict(cache, q=q[:, t:t + 1], k_new=k[:, t:t + 1], v_new=v[:, t:t + 1])
        got = _kernel(step, 0, np.full(rows, t, np.int32), np.ones((rows, 1, 1), bool), 0.125)
        for b in range(rows):
            if t < lengths[b]:
                np.testing.assert_array_equal(got[b, 0].view(np.uint32),
                                              prefill[b, t].view(np.uint32))
    np.testing.assert_array_equal(prefill[1, 41:], 0.0)


def test_a_negative_length_is_an_empty_row_and_a_window_must_be_positive():
    q, k, v = _row_operands(2, 20, 4, 2, 32)
    got = _row_kernel(q, k, v, [-3, 20], 0.25)
    np.testing.assert_array_equal(got[0], 0.0)
    np.testing.assert_allclose(got[1], _row_kernel(q[1:], k[1:], v[1:], [20], 0.25)[0], atol=0)
    with pytest.raises(ValueError, match="sliding window of 0 tokens"):
        cpu_attention.attend_rows(q, k, v, np.array([20, 20]), scale=0.25, window=0,
                                  otherwise=None)


def _custom_calls(f, *args, target=cpu_attention.TARGET, **lower) -> int:
    return jax.jit(f).trace(*args).lower(**lower).as_text().count(target)


def test_attend_segments_runs_the_prefill_kernel_only_where_it_applies():
    q, k, v = _row_operands(2, 20, 4, 2, 64)
    segments = (np.arange(20)[None] < np.array([[20], [9]])).astype(np.int32)
    calls = functools.partial(_custom_calls, target=cpu_attention.ROW_TARGET)

    def attend(q, k, v, **kw):
        return fused_attention.attend_segments(q, k, v, segments, scale=0.125, **kw)

    on = dict(implementation="cpu", max_segments=1)
    assert fused_attention.default_prefill_implementation() == "cpu"
    assert fused_attention.default_implementation() == "einsum"  # training's: differentiable
    assert calls(lambda *a: attend(*a, **on), q, k, v) == 1
    assert calls(lambda *a: attend(*a, **dict(on, max_segments=None)), q, k, v) == 0  # packed
    half = [a.astype(jnp.bfloat16) for a in (q, k, v)]
    assert calls(lambda *a: attend(*a, **on), *half) == 0
    assert calls(lambda *a: attend(*a, **on), q, k, v, lowering_platforms=("cuda",)) == 0
    got = jax.jit(lambda *a: attend(*a, **on))(q, k, v)
    want = jax.jit(lambda *a: attend(*a, implementation="einsum"))(q, k, v)
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-6)


def test_attend_cache_runs_it_only_where_it_applies():
    x = _operands(2, 1, 3, 4, 2, 64, 32)
    visible = np.ones((1, 3, 3), bool)
    lengths = np.array([20], np.int32)
    committed = np.broadcast_to(np.arange(32) < lengths[0], (1, 3, 32))

    def attend(q, k_cache, v_cache, k_new, v_new, **kw):
        return fused_attention.attend_cache(q, k_cache, v_cache, committed, k_new, v_new, visible,
                                            scale=0.125, **kw)

    args = [x[k] for k in ("q", "k_cache", "v_cache", "k_new", "v_new")]
    on = dict(layer=jnp.int32(1), lengths=lengths, implementation="cpu")
    assert fused_attention.default_cache_implementation() == "cpu"
    assert _custom_calls(lambda *a: attend(*a, **on), *args) == 1
    assert _custom_calls(lambda *a: attend(*a, **dict(on, lengths=None)), *args) == 0  # a window
    assert _custom_calls(lambda *a: attend(*a, **dict(on, implementation="einsum")), *args) == 0
    half = [a.astype(jnp.bfloat16) for a in args]
    assert _custom_calls(lambda *a: attend(*a, **on), *half) == 0
    with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((2,), ("data",))):
        assert not cpu_attention.applies(*args, True)  # the einsum, partitioned
    assert cpu_attention.applies(*args, True)
    # Lowered for another platform, the program attends with the einsum.
    assert _custom_calls(lambda *a: attend(*a, **on), *args, lowering_platforms=("cuda",)) == 0
    got = jax.jit(lambda *a: attend(*a, **on))(*args)
    want = jax.jit(lambda *a: attend(*a, **dict(on, implementation="einsum")))(*args)
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-6)


def test_bad_input_is_named_and_it_can_be_turned_off():
    x = _operands(2, 1, 1, 2, 1, 16, 8)
    with pytest.raises(Exception, match="layer index out of range"):
        _kernel(x, 2, np.array([3], np.int32), np.ones((1, 1, 1), bool), 0.25)
    env = dict(os.environ, DSPARK_JAX_CPU_ATTENTION="0")
    off = subprocess.run([sys.executable, "-c", "from dspark_jax.models import fused_attention; "
                          "print(fused_attention.default_cache_implementation())"],
                         env=env, capture_output=True, text=True, check=True)
    assert off.stdout.strip() == "einsum"


# A target whose heads the kernel takes (the other engine tests' Qwen3 has 8-wide heads, which
# attend through the einsum).
LLAMA = dict(architectures=["LlamaForCausalLM"], vocab_size=48, hidden_size=32,
             intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, eos_token_id=3, max_position_embeddings=512)
PROMPTS = [[5, 9, 11, 7], [4, 8, 15, 16, 23, 42, 7, 6, 10, 12, 14, 20, 21], [17]]


# bfloat16 weights: slow (test_weight_dtype.py checks their engine in the default run).
@pytest.mark.parametrize("weight_dtype", [None, pytest.param("bfloat16", marks=pytest.mark.slow)])
def test_the_engine_attends_through_it_and_speculative_equals_autoregressive(weight_dtype):
    target = init_target(LLAMA, seed=4)
    drafter = dspark_jax.init_drafter(target, seed=5)
    kw = dict(max_new_tokens=16, weight_dtype=weight_dtype)
    engine.clear_compiled_programs()
    ar = [r.token_ids for r in dspark_jax.generate(target, PROMPTS, **kw)]
    texts = [p.as_text() for p in engine.compiled_programs()]
    assert any(cpu_attention.TARGET in t for t in texts)
    assert any(cpu_attention.ROW_TARGET in t for t in texts)  # the prefill's
    sp = [r.token_ids for r in dspark_jax.generate(target, PROMPTS, drafter=drafter, **kw)]
    assert sp == ar and any(len(t) > 1 for t in ar)

