"""Layer weights held one array per layer (``models.layer_weights``): the decoder computes exactly
what it computes over the stacked arrays, XLA:CPU's program no longer copies the weight
matrices out of the stacks, and the engine decodes the same tokens in both layouts."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import dspark_jax
from dspark_jax.engine import Engine
from dspark_jax.models import cpu_matmul, layer_weights
from dspark_jax.models.kv_cache import KVCache
from dspark_jax.models.ragged import ragged_forward
from dspark_jax.target import init_target

from test_ragged import GEMMA3, GEMMA4, QWEN3

CONFIGS = pytest.mark.parametrize("config", [QWEN3, GEMMA3, GEMMA4], ids=["qwen3", "gemma3", "gemma4"])


def _cached_forward(graphdef, state, tokens):
    """A prefill of ``tokens`` [B, T] into a cache, then two more tokens through it."""
    model = nnx.merge(graphdef, state)
    rows, width = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(width), (rows, width))
    cache = KVCache.for_model(model.config, rows, 16, jnp.float32, True)
    first = model(tokens, positions, cache=cache, tap_layer_ids=(-1, 1))
    second = model(tokens[:, :2], positions[:, :2] + width, cache=first.cache)
    return first.hidden, first.taps, second.hidden, second.cache.k, second.cache.v


@CONFIGS
@pytest.mark.parametrize("kernel", [False, True], ids=["xla-dot", "cpu-matmul"])
def test_unstacked_weights_compute_what_the_stacks_compute(config, kernel, monkeypatch):
    """Exactly with XLA's dot in both (a host without the kernel: the arrays [in, out]); with
    ``cpu_matmul`` (the per-layer arrays' few-row float32 products on CPU, held [out, in],
    another summation order) to float32 rounding."""
    if not kernel:
        monkeypatch.setattr(cpu_matmul, "available", lambda: False)
        monkeypatch.setattr(cpu_matmul, "applies", lambda *a, **k: False)
    elif not cpu_matmul.available():
        pytest.skip("no cpu_matmul kernel on this host")
    check = (np.testing.assert_array_equal if not kernel
             else lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-5))
    target = init_target(config, seed=3)
    unstacked = target.inference_state("unstacked")
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 48, (2, 6)))
    forward = jax.jit(_cached_forward, static_argnums=0)
    want = forward(target.graphdef, target.state, tokens)
    got = forward(target.graphdef, unstacked, tokens)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        check(a, b)
    # The flat (ragged) forward of the engine's rounds too.
    cache = KVCache.for_model(target.config, 2, 16, jnp.float32, True)
    args = (tokens.reshape(-1), jnp.tile(jnp.arange(6), 2), jnp.repeat(jnp.arange(2), 6),
            jnp.tile(jnp.arange(6), 2), jnp.zeros((2,), jnp.int32), cache)
    ragged = jax.jit(lambda g, s, *a: ragged_forward(nnx.merge(g, s), *a, width=6), static_argnums=0)
    check(ragged(target.graphdef, unstacked, *args).hidden,
          ragged(target.graphdef, target.state, *args).hidden)


@CONFIGS
def test_only_the_layer_stacks_matrices_are_unstacked(config):
    target = init_target(config, seed=3)
    unstacked = target.inference_state("unstacked")
    assert target.inference_state("unstacked") is unstacked  # made once per state
    assert target.inference_state("stacked") is target.state
    flat = dict(nnx.to_flat_state(unstacked))
    split = {path for path, v in flat.items() if isinstance(v.get_value(), layer_weights.Unstacked)}
    stacks = [n for n in ("layers", "global_layers") if n in target.state]
    kernels = {path for path, v in dict(nnx.to_flat_state(target.state)).items()
               if path[0] in stacks and path[-1] == "kernel"}
    assert split == kernels and split
    for path in split:
        whole = dict(nnx.to_flat_state(target.state))[path].get_value()
        parts = flat[path].get_value()
        assert parts.shape == whole.shape and len(parts.layers) == whole.shape[0]
    # Everything else (embedding, norms, biases) is the same array, not a copy.
    for path, v in dict(nnx.to_flat_state(target.state)).items():
        if path not in split:
            assert flat[path].get_value() is v.get_value()
    with pytest.raises(ValueError, match="unknown layer weight layout 'rows'"):
        target.inference_state("rows")
    # A new state is followed: its layouts are made anew.
    target.state = jax.tree.map(lambda x: x + 0, target.state)
    again = target.inference_state("unstacked")
    assert again is not unstacked and target.inference_state("stacked") is target.state


def _weight_slices(target, layout) -> int:
    """Dynamic slices in the optimised decode program whose shape is a layer's weight matrix."""
    compiled = jax.jit(_cached_forward, static_argnums=0).lower(
        target.graphdef, target.inference_state(layout), jnp.zeros((1, 4), jnp.int32)).compile()
    shapes = {f"f32[{','.join(map(str, kernel.shape[1:]))}]"
              for path, kernel in nnx.to_flat_state(target.state)
              if path[0] == "layers" and path[-1] == "kernel"}
    # A dynamic-slice or copy op, or a fusion named for one, of a weight matrix's shape.
    ops = re.findall(r"%[\w.-]*(?:dynamic-slice|copy)[\w.-]* = (f32\[[0-9,]+\])|= (f32\[[0-9,]+\])"
                     r"\{[^}]*\} (?:dynamic-slice|copy)\(", compiled.as_text())
    return sum(a in shapes or b in shapes for a, b in ops)


def test_the_cpu_program_reads_per_layer_weights_without_slicing_them():
    target = init_target(QWEN3, seed=3)
    assert _weight_slices(target, "stacked") > 0  # XLA:CPU copies each layer's slice
    assert _weight_slices(target, "unstacked") == 0


MESH_SCRIPT = """
import json, jax, numpy as np
from dspark_jax.models import cpu_matmul, layer_weights
from dspark_jax.target import init_target
target = init_target(dict(architectures=["Qwen3ForCausalLM"], vocab_size=48, hidden_size=32,
                          intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
                          num_key_value_heads=2, head_dim=8), seed=3)
mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("data",))
replicated = jax.device_put(target.state, jax.sharding.NamedSharding(mesh, jax.P()))
print("REPORT " + json.dumps({"one": layer_weights.default_layout(target.state, 1),
                              "four": layer_weights.default_layout(target.state, 4),
                              "five": layer_weights.default_layout(target.state, 5),
                              "many": layer_weights.default_layout(target.state, 33),
                              "two": layer_weights.default_layout(replicated, 1)}))
"""


@pytest.mark.parametrize("kernel", ["1", "0"], ids=["cpu-matmul", "xla-dot"])
def test_the_default_layout_unstacks_for_few_rows_on_one_cpu_device(kernel, monkeypatch):
    """Up to 4 rows, or up to cpu_matmul.MAX_ROWS (32) where that kernel runs."""
    from conftest import run_on_cpu_devices

    if kernel == "1" and not cpu_matmul.available():
        pytest.skip("no cpu_matmul kernel on this host")
    monkeypatch.setenv("DSPARK_JAX_CPU_MATMUL", kernel)
    report = run_on_cpu_devices(["-c", MESH_SCRIPT], devices=2)
    five = "unstacked" if kernel == "1" else "stacked"
    assert report == {"one": "unstacked", "four": "unstacked", "five": five, "many": "stacked",
                      "two": "stacked"}


def test_engines_take_the_default_layout_for_their_slots_or_the_one_asked_for():
    target = init_target(QWEN3, seed=3)
    assert Engine(target, slots=4, max_len=32).layer_weights == "unstacked"
    assert Engine(target, slots=33, max_len=32).layer_weights == "stacked"
    if cpu_matmul.available():  # up to 32 rows per forward: slots x (P + 1) with a drafter
        drafter = dspark_jax.init_drafter(target, seed=2)
        wide = 32 // (1 + drafter.num_proposals) + 1
        assert Engine(target, slots=8, max_len=32).layer_weights == "unstacked"
        assert Engine(target, drafter, slots=wide, max_len=32).layer_weights == "stacked"
        assert Engine(target, drafter, slots=1, max_len=32).layer_weights == "unstacked"
    assert Engine(target, slots=1, max_len=32, layer_weights="stacked").layer_weights == "stacked"
    with pytest.raises(ValueError, match="unknown layer weight layout"):
        Engine(target, slots=1, max_len=32, layer_weights="rows")


# One layer: both layouts have as many leaves (their programs must still not be confused). The
# greedy three-layer cases repeat the sampled ones' programs at another temperature: slow.
CASES = ([pytest.param(0.0, d, 3, marks=pytest.mark.slow) for d in (False, True)]
         + [(1.0, d, 3) for d in (False, True)] + [(0.0, False, 1)])


@pytest.mark.parametrize("temperature,drafted,layers", CASES)
def test_the_engine_decodes_the_same_tokens_in_both_layouts(temperature, drafted, layers):
    target = init_target(dict(QWEN3, eos_token_id=3, num_hidden_layers=layers), seed=1)
    drafter = dspark_jax.init_drafter(target, seed=2) if drafted else None
    prompts = [[5, 9, 11, 7], [4, 8, 15, 16, 23, 42], [17]]
    runs = {layout: [r.token_ids for r in dspark_jax.generate(
        target, prompts, max_new_tokens=12, temperature=temperature, seed=4, drafter=drafter,
        layer_weights=layout)] for layout in layer_weights.LAYOUTS}
    assert runs["stacked"] == runs["unstacked"]
    assert any(len(t) > 1 for t in runs["stacked"])
