"""bfloat16 weight matrices under a float32 target (``layer_weights.with_dtype``,
``Engine(weight_dtype=)``): only the matrices change dtype, every matmul multiplies the
activations rounded to bfloat16 and accumulates in float32, and the engine keeps greedy
speculative output equal to greedy autoregressive output in that dtype."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import dspark_jax
from dspark_jax.engine import Engine
from dspark_jax.models import cpu_matmul, layer_weights
from dspark_jax.models.layers import Linear, with_min_rows
from dspark_jax.target import init_target

from test_ragged import GEMMA4, QWEN3

TIED = dict(QWEN3, tie_word_embeddings=True)  # Qwen3's configs untie by default
UNTIED = dict(QWEN3, tie_word_embeddings=False)
PROMPTS = [[5, 9, 11, 7], [4, 8, 15, 16, 23, 42, 7, 6, 10, 12], [17]]


def _flat(state) -> dict:
    return {path: v.get_value() for path, v in nnx.to_flat_state(state)}


@pytest.mark.parametrize("config", [TIED, UNTIED, GEMMA4], ids=["tied", "untied", "gemma4"])
def test_only_the_weight_matrices_take_the_dtype(config):
    target = init_target(config, seed=3)
    state = target.inference_state("stacked", jnp.bfloat16)
    assert target.inference_state("stacked", "bfloat16") is state  # made once per state
    assert target.inference_state("stacked") is target.state
    stacks = [n for n in ("layers", "global_layers") if n in target.state]
    matrices = {path for path, value in _flat(target.state).items()
                if (path[0] in stacks and path[-1] == "kernel")
                or path in (("embed_tokens", "embedding"), ("lm_head",))}
    assert (("lm_head",) in matrices) == (config is UNTIED)
    for path, value in _flat(state).items():
        original = _flat(target.state)[path]
        if path in matrices:
            assert value.dtype == jnp.bfloat16
            np.testing.assert_array_equal(value, original.astype(jnp.bfloat16))
        else:  # norms, biases, scalars: the same float32 arrays
            assert value is original and value.dtype == jnp.float32
    # Both layouts of the bfloat16 matrices.
    unstacked = _flat(target.inference_state("unstacked", jnp.bfloat16))
    split = [v for v in unstacked.values() if isinstance(v, layer_weights.Unstacked)]
    assert split and all(v.dtype == jnp.bfloat16 for v in split)


@pytest.mark.parametrize("layout", layer_weights.LAYOUTS)
def test_a_linear_layer_multiplies_in_bfloat16_and_accumulates_in_float32(layout):
    layer = Linear(64, 48, names=("embed", "mlp"), dtype=jnp.float32, rngs=nnx.Rngs(0), bias=True)
    layer.bias.set_value(jnp.linspace(-1, 1, 48))
    x = jax.random.normal(jax.random.key(1), (3, 5, 64), jnp.float32)
    w = layer.kernel.get_value()
    layer.kernel.set_value(w.astype(jnp.bfloat16))
    if layout == "unstacked":  # one layer of a stack, as a layer scan reads it
        stack = layer_weights.Unstacked([w.astype(jnp.bfloat16)] * 2)
        layer.kernel.set_value(stack.at(jnp.asarray(1)))
    y = jax.jit(lambda x: layer(x))(x)
    assert y.dtype == jnp.float32
    # bfloat16 products are exact in float32: only the order of the float32 sums may differ.
    rounded = lambda a: np.asarray(a.astype(jnp.bfloat16).astype(jnp.float32), np.float64)
    want = rounded(x) @ rounded(w) + np.asarray(layer.bias.get_value(), np.float64)
    np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-5)
    # ... which a bfloat16 result (rounded to 8 bits) would miss.
    assert np.abs(rounded(y) - want).max() > 1e-3


def test_bfloat16_weights_keep_the_logits_close():
    """The tolerance of the bfloat16 matrices on a tiny random Qwen3 (SmolLM2's is measured in
    BENCHMARKS.md): the logits within 2% of their range, the same argmax at most positions."""
    target = init_target(dict(QWEN3, num_hidden_layers=4), seed=3)
    ids = jnp.asarray(np.random.default_rng(0).integers(0, 48, (4, 16)))

    def logits(state):
        model = nnx.merge(target.graphdef, state)
        positions = jnp.broadcast_to(jnp.arange(16), ids.shape)
        return model.logits(model(ids, positions).hidden)

    want = np.asarray(logits(target.state))
    got = np.asarray(logits(target.inference_state("stacked", jnp.bfloat16)))
    assert got.dtype == np.float32
    scale = want.max() - want.min()
    assert 0 < np.abs(got - want).max() < 0.02 * scale
    assert (got.argmax(-1) == want.argmax(-1)).mean() > 0.9


@pytest.mark.parametrize("config", [TIED, UNTIED], ids=["tied", "untied"])
def test_bfloat16_head_is_multiplied_as_stored(config):
    """The LM head in bfloat16 is multiplied as it is held (the tied one as the embedding's
    [V, d] rows): the compiled logits hold no float32 copy of it, which XLA:CPU otherwise
    makes of a transposed bfloat16 table in every step."""
    shape = dict(config, vocab_size=49152, hidden_size=576, num_attention_heads=9,
                 num_key_value_heads=3, head_dim=64, num_hidden_layers=1)  # SmolLM2's head
    target = init_target(shape, seed=3)
    state = target.inference_state("stacked", jnp.bfloat16)
    hidden = jnp.ones((1, 576), jnp.float32)

    def logits(state, hidden):
        return nnx.merge(target.graphdef, state).logits(hidden)

    hlo = jax.jit(logits).lower(state, hidden).compile().as_text()
    assert "f32[49152,576]" not in hlo and "f32[576,49152]" not in hlo
    np.testing.assert_allclose(logits(state, hidden), logits(target.state, hidden), rtol=0.02,
                               atol=0.02 * float(jnp.abs(logits(target.state, hidden)).max()))


def test_bfloat16_weights_read_in_place_on_one_cpu_for_any_number_of_slots():
    target = init_target(QWEN3, seed=3)
    assert layer_weights.default_layout(target.state, 64, jnp.bfloat16) == "unstacked"
    assert layer_weights.default_layout(target.state, 64, jnp.float32) == "stacked"
    engine = Engine(target, slots=8, max_len=32, weight_dtype="bfloat16")
    assert engine.layer_weights == "unstacked" and engine.weight_dtype == jnp.bfloat16
    assert Engine(target, slots=33, max_len=32).layer_weights == "stacked"


@pytest.mark.parametrize("layout", [
    "unstacked",  # a CPU's layout for a few rows
    pytest.param("stacked", marks=pytest.mark.slow)])  # its programs are this test's alone
def test_greedy_speculative_equals_greedy_autoregressive_with_bfloat16_weights(layout):
    """The engine's programs in bfloat16 weights: on this tiny target the verify and the decode
    step compute the same greedy tokens. (On a real model the float32 attention's last bits
    depend on the batch, the cache view and the verify width, bfloat16 rounding can make them
    count, and a near-tie may then fall either way, in autoregressive decoding at two batch
    sizes as well: BENCHMARKS.md, benchmarks/batch_invariance.py.)"""
    target = init_target(dict(QWEN3, eos_token_id=3, num_hidden_layers=4), seed=1)
    drafter = dspark_jax.init_drafter(target, seed=2)
    kw = dict(max_new_tokens=16, weight_dtype="bfloat16", layer_weights=layout)
    ar = [r.token_ids for r in dspark_jax.generate(target, PROMPTS, **kw)]
    sp = [r.token_ids for r in dspark_jax.generate(target, PROMPTS, drafter=drafter, **kw)]
    assert sp == ar and any(len(t) > 1 for t in ar)



def test_a_drafters_matrices_take_the_dtype_and_are_read_in_place():
    """``Drafter.inference_state(bfloat16)``: its layers' matrices (one array per layer on a
    CPU) and its context projection in bfloat16, everything else as it was; the draft step
    reads the matrices in place (no dynamic slice of a layer's kernel in the compiled program)
    and drafts within bfloat16's tolerance of the float32 drafter. The same per-layer arrays in
    float32 give the stacked drafter's bits (both through XLA's dot)."""
    target = init_target(dict(QWEN3, num_hidden_layers=4), seed=3)
    drafter = dspark_jax.init_drafter(target, seed=2)
    plain = drafter.inference_state()  # float32: the stacks, or per-layer arrays (cpu_matmul)
    assert drafter.inference_state() is plain
    if layer_weights.default_layout(drafter.state, drafter.config.block_size) == "stacked":
        assert plain is drafter.state
    else:
        for path, value in _flat(plain).items():
            if isinstance(value, layer_weights.Unstacked):
                layers = [w.T if value.transposed else w for w in value.layers]  # [out, in] held
                np.testing.assert_array_equal(jnp.stack(layers), _flat(drafter.state)[path])
    state = drafter.inference_state(jnp.bfloat16)
    assert drafter.inference_state("bfloat16") is state
    flat, original = _flat(state), _flat(drafter.state)
    for path, value in flat.items():
        if path[0] == "layers" and path[-1] == "kernel":
            assert isinstance(value, layer_weights.Unstacked) and value.dtype == jnp.bfloat16
        elif path == ("fc", "kernel"):
            np.testing.assert_array_equal(value, original[path].astype(jnp.bfloat16))
        else:
            assert value is original[path]
    model = drafter.model
    cache = model.init_cache(2, 32)
    taps = len(drafter.config.target_layer_ids) * target.config.hidden_size
    ctx_taps = jax.random.normal(jax.random.key(0), (2, 5, taps))
    args = dict(ctx_taps=ctx_taps, ctx_positions=jnp.broadcast_to(jnp.arange(5), (2, 5)),
                anchor_tokens=jnp.asarray([7, 9]), anchor_positions=jnp.asarray([5, 5]))

    def draft(state, cache):
        m = nnx.merge(drafter.graphdef, state)
        return m.draft(nnx.merge(target.graphdef, target.state), cache=cache, **args).hidden

    with pytest.MonkeyPatch.context() as patch:  # XLA's dot for both (not cpu_matmul's order)
        patch.setattr(cpu_matmul, "available", lambda: False)  # so the arrays stay [in, out]
        patch.setattr(cpu_matmul, "applies", lambda *a, **k: False)
        split32 = layer_weights.with_layout(drafter.state, ("layers",), "unstacked")
        np.testing.assert_array_equal(jax.jit(draft)(split32, cache),
                                      jax.jit(draft)(drafter.state, cache))
    want = np.asarray(jax.jit(draft)(drafter.state, cache))
    got = np.asarray(jax.jit(draft)(state, cache))
    assert 0 < np.abs(got - want).max() < 0.05 * np.abs(want).max()
    hlo = jax.jit(draft).lower(state, cache).compile().as_text()
    kernels = {f"bf16[{','.join(map(str, v.shape[1:]))}]" for path, v in flat.items()
               if path[0] == "layers" and path[-1] == "kernel"}
    assert not [line for line in hlo.splitlines()
                if "dynamic-slice" in line and any(k in line.split("=")[1] for k in kernels)]


@pytest.mark.parametrize("vocab", [
    np.arange(0, 48, 2),  # bfloat16 layers and bfloat16 draft-vocabulary rows of the head
    pytest.param(None, marks=pytest.mark.slow)],  # bfloat16 layers, the whole float32 head
    ids=["draft-vocab", "whole-vocab"])
def test_greedy_speculative_with_a_bfloat16_drafter_equals_autoregressive(vocab):
    """A drafter's matrices in bfloat16 change its draft law only: greedy output is still the
    float32 target's own, with and without a draft vocabulary."""
    target = init_target(dict(QWEN3, eos_token_id=3, num_hidden_layers=4), seed=1)
    drafter = dspark_jax.init_drafter(target, seed=2)
    ar = [r.token_ids for r in dspark_jax.generate(target, PROMPTS, max_new_tokens=16)]
    drafter.restrict_vocab(vocab)
    engine = Engine(target, drafter, slots=1, max_len=64, draft_weight_dtype="bfloat16")
    assert engine.draft_weight_dtype == jnp.bfloat16
    if vocab is not None:
        assert engine._draft_vocab.lm_head_rows.dtype == jnp.bfloat16
    sp = [r.token_ids for r in dspark_jax.generate(target, PROMPTS, max_new_tokens=16,
                                                   drafter=drafter, draft_weight_dtype="bfloat16")]
    assert sp == ar and any(len(t) > 1 for t in ar)


def test_a_rows_bfloat16_product_does_not_depend_on_the_other_rows():
    """XLA:CPU's bfloat16 matmul gives a row the same bits for any number of rows from 3 on,
    but others for 1 or 2 rows (and runs slowest for 1); ``layers.with_min_rows`` pads a
    product to ``MIN_ROWS`` rows, so a layer matrix and the LM head give a token the bits it
    gets in any batch or verify."""
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((16, 576)), jnp.float32)
    linear = Linear(576, 1536, names=("embed", "mlp"), dtype=jnp.float32, rngs=nnx.Rngs(0))
    linear.kernel.set_value(linear.kernel.get_value().astype(jnp.bfloat16))
    head = jnp.asarray(rng.standard_normal((4096, 576)), jnp.bfloat16)  # [V, d], tied
    products = {"linear": jax.jit(lambda x: linear(x)),
                "head": jax.jit(lambda x: with_min_rows(
                    lambda h: jnp.einsum("...d,vd->...v", h, head,
                                         preferred_element_type=jnp.float32),
                    x.astype(jnp.bfloat16)))}
    for name, product in products.items():
        every_row = np.asarray(product(x))
        for rows in (1, 2, 3, 8):
            np.testing.assert_array_equal(np.asarray(product(x[:rows])), every_row[:rows],
                                          err_msg=f"{name}, {rows} rows")
        np.testing.assert_array_equal(np.asarray(product(x[0])), every_row[0])  # no row axis
