"""The fused attention paths of the packed target forward equal the einsum reference: the
kernels alone and the whole decoder, with segments, padding, GQA and sliding windows.

``xla`` is jax.nn.dot_product_attention's portable implementation (the arguments the cuDNN
route passes, checked on a CPU); ``splash`` runs splash attention's Pallas kernel in interpret
mode, as a TPU would run it compiled."""

from __future__ import annotations

import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import run_on_cpu_devices
from dspark_jax.models import fused_attention
from dspark_jax.models.layers import attend
from dspark_jax.target import init_target

FUSED = ("xla", "splash")


def _segments(rng, b, t):
    """Segment ids of packed rows: several segments and trailing padding (0)."""
    ids = np.zeros((b, t), np.int32)
    for row in range(b):
        cuts = np.sort(rng.choice(np.arange(1, t - 8), 3, replace=False))
        for seg, (lo, hi) in enumerate(zip([0, *cuts], [*cuts, t - 8 * row]), start=1):
            ids[row, lo:hi] = seg
    return jnp.asarray(ids)


@pytest.mark.parametrize("implementation", FUSED)
@pytest.mark.parametrize("window", [None, 9])
def test_kernels_equal_the_einsum_reference(implementation, window):
    rng = np.random.default_rng(0)
    b, t, h, kv, d = 2, 256, 6, 2, 32
    q, k, v = (jnp.asarray(rng.normal(size=(b, t, n, d)), jnp.float32) for n in (h, kv, kv))
    segments = _segments(rng, b, t)
    ref = fused_attention.attend_segments(q, k, v, segments, scale=0.2, window=window,
                                          implementation="einsum")
    out = jax.jit(lambda *a: fused_attention.attend_segments(
        *a, scale=0.2, window=window, implementation=implementation))(q, k, v, segments)
    real = np.asarray(segments) != 0
    assert np.abs(np.asarray(ref)[real]).max() > 0.1
    np.testing.assert_allclose(np.asarray(out)[real], np.asarray(ref)[real], atol=2e-5)


@pytest.mark.parametrize("window", [None, 9])
def test_one_segment_per_row_reaches_the_kernel_as_lengths(window):
    """``max_segments=1`` (a prefill, a feature-cache row): jax.nn.dot_product_attention's
    sequence lengths instead of a mask; padding outputs are zeros."""
    rng = np.random.default_rng(5)
    b, t, h, kv, d = 3, 64, 4, 2, 16
    q, k, v = (jnp.asarray(rng.normal(size=(b, t, n, d)), jnp.float32) for n in (h, kv, kv))
    segments = jnp.asarray(np.arange(t)[None] < np.array([[64], [37], [1]]), jnp.int32)
    ref = fused_attention.attend_segments(q, k, v, segments, scale=0.2, window=window,
                                          implementation="einsum")
    out = jax.jit(lambda *a: fused_attention.attend_segments(
        *a, scale=0.2, window=window, implementation="xla", max_segments=1))(q, k, v, segments)
    real = np.asarray(segments) != 0
    np.testing.assert_allclose(np.asarray(out)[real], np.asarray(ref)[real], atol=2e-5)
    assert np.all(np.asarray(out)[~real] == 0)


def test_packed_segments_are_starts_and_lengths():
    segments = jnp.asarray([[1, 1, 1, 2, 2, 3, 0, 0],
                            [1, 1, 1, 1, 1, 1, 1, 1],
                            [0, 0, 0, 0, 0, 0, 0, 0]], jnp.int32)
    starts, lengths = fused_attention.packed_segments(segments, 3)
    np.testing.assert_array_equal(starts, [[0, 3, 5, -1], [0, -1, -1, -1], [-1, -1, -1, -1]])
    np.testing.assert_array_equal(lengths, [[3, 2, 1], [8, -1, -1], [-1, -1, -1]])
    starts, lengths = fused_attention.packed_segments(segments, 2)  # segment 3 left out
    np.testing.assert_array_equal(starts[0], [0, 3, -1])
    np.testing.assert_array_equal(lengths[0], [3, 2])


GEMMA4 = dict(architectures=["Gemma4ForCausalLM"], vocab_size=64, hidden_size=32,
              intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, head_dim=8, global_head_dim=16, num_global_key_value_heads=1,
              attention_k_eq_v=True, hidden_size_per_layer_input=0, sliding_window=5,
              layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"])
GEMMA3 = dict(GEMMA4, architectures=["Gemma3ForCausalLM"])
QWEN3 = dict(GEMMA4, architectures=["Qwen3ForCausalLM"], layer_types=None, sliding_window=None)


@pytest.mark.parametrize("implementation", FUSED)
@pytest.mark.parametrize("config", [QWEN3, GEMMA3, GEMMA4], ids=["qwen3", "gemma3", "gemma4"])
def test_the_packed_target_forward_equals_the_masked_one(config, implementation):
    """Gemma3 mixes its layer types in one stack: the fused forward runs them in scans of one
    type each, so that a sliding layer's window is static."""
    target = init_target({k: v for k, v in config.items() if v is not None}, seed=1)
    model = target.model
    rng = np.random.default_rng(2)
    b, t = 2, 128
    segments = _segments(rng, b, t)
    tokens = jnp.asarray(rng.integers(0, 64, (b, t)))
    starts = np.asarray(jax.vmap(lambda s: jnp.searchsorted(s, s, side="left"))(segments))
    positions = jnp.asarray(np.arange(t)[None] - starts)  # restart at every segment
    taps = (-1, 1, 3)
    ref = model(tokens, positions, mask=fused_attention.segment_mask(segments), tap_layer_ids=taps)
    out = jax.jit(lambda m_tokens, m_pos, m_seg: model(
        m_tokens, m_pos, segment_ids=m_seg, attention=implementation, tap_layer_ids=taps))(
        tokens, positions, segments)
    real = np.asarray(segments) != 0
    np.testing.assert_allclose(np.asarray(out.hidden)[real], np.asarray(ref.hidden)[real], atol=1e-4)
    np.testing.assert_allclose(np.asarray(out.taps)[real], np.asarray(ref.taps)[real], atol=1e-4)


def test_bad_uses_are_named():
    x = jnp.zeros((1, 100, 2, 8))
    segments = jnp.ones((1, 100), jnp.int32)
    with pytest.raises(ValueError, match="multiple of 128, got 100"):
        fused_attention.attend_segments(x, x, x, segments, implementation="splash")
    with pytest.raises(ValueError, match="unknown attention implementation 'flash'"):
        fused_attention.attend_segments(x, x, x, segments, implementation="flash")
    model = init_target({k: v for k, v in QWEN3.items() if v is not None}, seed=1).model
    tokens = jnp.zeros((1, 4), jnp.int32)
    with pytest.raises(ValueError, match="segment_ids replace the mask"):
        model(tokens, tokens, segment_ids=tokens, mask=jnp.ones((1, 4, 4), bool))


@pytest.mark.parametrize("implementation", FUSED)
def test_the_engine_prefill_equals_the_einsum_one(implementation):
    """The engine's ragged prefill (a cache of no slots): rows of different lengths in a grid
    of 128 columns, over Gemma4's interleaved stacks and sliding windows."""
    from dspark_jax.models.kv_cache import KVCache
    from dspark_jax.models.ragged import ragged_forward

    target = init_target(GEMMA4, seed=3)
    model = target.model
    rng = np.random.default_rng(4)
    lengths, width = np.array([100, 37, 128]), 128
    rows = np.concatenate([np.full(n, r) for r, n in enumerate(lengths)] + [[3, 3]])
    cols = np.concatenate([np.arange(n) for n in lengths] + [[0, 0]])
    tokens = jnp.asarray(rng.integers(0, 64, rows.shape))
    cache = KVCache.for_model(model.config, len(lengths), 0, jnp.float32)

    def prefill(impl):
        return jax.jit(lambda *a: ragged_forward(model, *a, width=width, tap_layer_ids=(1, 2),
                                                 attention=impl))(
            tokens, jnp.asarray(cols), jnp.asarray(rows), jnp.asarray(cols),
            jnp.zeros(len(lengths), jnp.int32), cache)

    ref, out = prefill("einsum"), prefill(implementation)
    real = rows < len(lengths)
    np.testing.assert_allclose(np.asarray(out.hidden)[real], np.asarray(ref.hidden)[real], atol=1e-4)
    np.testing.assert_allclose(np.asarray(out.taps)[real], np.asarray(ref.taps)[real], atol=1e-4)
    for got, want in zip(jax.tree.leaves(out.new_k), jax.tree.leaves(ref.new_k), strict=True):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-4)


def _draft_block_args(rng, dtype=jnp.float32, d=16):
    """attend_draft_blocks' arguments for packed rows, anchors in several segments and a dummy
    block; returns (args, block size, bool [B, T] tokens that see their block)."""
    from dspark_jax.models.drafter import block_attention_mask

    b, s, n, block, h, kv = 2, 64, 5, 4, 6, 2
    t = n * block
    segments = _segments(rng, b, s + 8)[:, :s]
    anchors = jnp.asarray(np.sort(rng.choice(np.arange(2, s - 2), (b, n), replace=True), axis=1))
    keep = jnp.asarray(np.arange(n)[None, :] < np.array([[n], [n - 1]]))  # row 1: one dummy
    mask = block_attention_mask(anchors=anchors, keep=keep, context_len=s, block_size=block,
                                segment_ids=segments)
    keep_tokens = jnp.repeat(keep, block, axis=1)
    q = jnp.asarray(rng.normal(size=(b, t, h, d)), dtype)
    k_ctx, v_ctx = (jnp.asarray(rng.normal(size=(b, s, kv, d)), dtype) for _ in range(2))
    k_blk, v_blk = (jnp.asarray(rng.normal(size=(b, t, kv, d)), dtype) for _ in range(2))
    return (q, k_ctx, v_ctx, mask.context, k_blk, v_blk, mask.keep), block, keep_tokens


def test_the_draft_block_attention_equals_the_blockwise_einsum():
    """XLA's dot_product_attention over [context; blocks] with the dense mask: packed rows,
    anchors in several segments, a dummy block (which sees nothing: zeros)."""
    args, block, keep_tokens = _draft_block_args(np.random.default_rng(1))
    ref = fused_attention.attend_draft_blocks(*args, block_size=block, scale=0.3,
                                              implementation="einsum")
    out = jax.jit(lambda *a: fused_attention.attend_draft_blocks(
        *a, block_size=block, scale=0.3, implementation="xla"))(*args)
    assert np.abs(np.asarray(ref)).max() > 0.1
    assert not np.asarray(keep_tokens).all() and np.all(np.asarray(out)[~np.asarray(keep_tokens)] == 0)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=2e-5)


def test_the_cudnn_route_asks_for_cudnn_and_falls_back_to_the_einsum(monkeypatch):
    """"cudnn" passes implementation="cudnn" to jax.nn.dot_product_attention (None would mean
    XLA's, which stores the scores) where cuDNN takes the inputs, and runs the einsum
    otherwise. The call is recorded and run by XLA's implementation here, on a CPU."""
    calls, real = [], jax.nn.dot_product_attention

    def recording(*args, implementation=None, **kwargs):
        calls.append(implementation)
        return real(*args, implementation="xla", **kwargs)

    monkeypatch.setattr(jax.nn, "dot_product_attention", recording)
    rng = np.random.default_rng(3)
    segments = _segments(rng, 2, 64)
    for dtype, d, expected in [(jnp.bfloat16, 16, ["cudnn"]), (jnp.float32, 16, []),
                               (jnp.bfloat16, 12, [])]:
        q, k, v = (jnp.asarray(rng.normal(size=(2, 64, h, d)), dtype) for h in (4, 2, 2))
        calls.clear()
        out = fused_attention.attend_segments(q, k, v, segments, implementation="cudnn")
        assert calls == expected, (dtype, d)
        ref = fused_attention.attend_segments(q, k, v, segments, implementation="einsum")
        real_rows = np.asarray(segments) != 0
        np.testing.assert_allclose(np.asarray(out, np.float32)[real_rows],
                                   np.asarray(ref, np.float32)[real_rows], atol=3e-2)
    q, k, v = (jnp.asarray(rng.normal(size=(2, 64, h, 16)), jnp.bfloat16) for h in (4, 2, 2))
    calls.clear()
    fused_attention.attend_segments(q, k, v, segments, implementation="cudnn", max_segments=1)
    assert calls == ["cudnn"]
    for dtype, expected in [(jnp.bfloat16, ["cudnn"]), (jnp.float32, [])]:
        args, block, _ = _draft_block_args(np.random.default_rng(1), dtype)
        calls.clear()
        out = fused_attention.attend_draft_blocks(*args, block_size=block, implementation="cudnn")
        assert calls == expected, dtype
        wide = [a.astype(jnp.float32) if a.dtype == dtype else a for a in args]
        ref = fused_attention.attend_draft_blocks(*wide, block_size=block, implementation="einsum")
        np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref, np.float32),
                                   atol=3e-2)


@pytest.mark.parametrize("window", [None, 9])
def test_packed_rows_reach_cudnn_as_segment_starts_and_lengths(monkeypatch, window):
    """Several segments per row (``max_segments`` > 1): cuDNN's packed layout, each segment a
    causal sequence at its start, and no mask. cuDNN's function is replaced here by an
    attention that reads only what cuDNN reads (starts, lengths, mask type, window)."""
    from jax._src.cudnn import fused_attention_stablehlo as cudnn

    calls = []

    def packed_reference(q, k, v, *, q_seqlen, kv_seqlen, q_offsets, kv_offsets, scale,
                         mask_type, sliding_window_length):
        calls.append(mask_type)
        assert mask_type == cudnn.MaskType.PADDING_CAUSAL
        assert sliding_window_length == window
        assert q_offsets is kv_offsets and q_seqlen is kv_seqlen
        column = jnp.arange(q.shape[1])
        starts, lengths = q_offsets[:, :-1, None], q_seqlen[:, :, None]  # [B, M, 1]
        inside = (column >= starts) & (column < starts + lengths) & (lengths > 0)  # [B, M, T]
        same = jnp.einsum("bmt,bms->bts", inside.astype(jnp.int32), inside.astype(jnp.int32)) > 0
        visible = same & (column[None, :] <= column[:, None])
        if sliding_window_length is not None:
            visible &= column[None, :] > column[:, None] - sliding_window_length
        return attend(q.astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32),
                      visible, scale=scale).astype(q.dtype)

    monkeypatch.setattr(cudnn, "dot_product_attention", packed_reference)
    rng = np.random.default_rng(6)
    segments = _segments(rng, 2, 64)  # four segments per row and padding
    q, k, v = (jnp.asarray(rng.normal(size=(2, 64, h, 16)), jnp.bfloat16) for h in (4, 2, 2))
    out = fused_attention.attend_segments(q, k, v, segments, scale=0.3, window=window,
                                          implementation="cudnn", max_segments=4)
    assert len(calls) == 1
    ref = fused_attention.attend_segments(*(x.astype(jnp.float32) for x in (q, k, v)), segments,
                                          scale=0.3, window=window, implementation="einsum")
    real = np.asarray(segments) != 0
    np.testing.assert_allclose(np.asarray(out, np.float32)[real], np.asarray(ref)[real], atol=2e-2)
    assert np.all(np.asarray(out, np.float32)[~real] == 0)


@pytest.mark.slow  # the attention equalities above run by default
def test_a_drafter_trains_through_the_fused_attention():
    """The train step's loss and gradients with `train.attention` "xla" equal the einsum's."""
    import dspark_jax
    from ml_collections import ConfigDict

    from dspark_jax import experiment
    from dspark_jax.training import step as train_step

    target = init_target(QWEN3, seed=0)
    drafter = dspark_jax.init_drafter(target, seed=1, num_layers=1, markov_rank=8, block_size=4,
                                      target_layer_ids=(0, 2), mask_token_id=63)
    rng = np.random.default_rng(2)
    b, s, n = 2, 32, 4
    batch = dict(input_ids=rng.integers(4, 60, (b, s)).astype(np.int32),
                 positions=np.tile(np.arange(s, dtype=np.int32), (b, 1)),
                 segment_ids=np.ones((b, s), np.int32), loss_mask=np.ones((b, s), np.int32),
                 anchors=np.sort(rng.choice(np.arange(1, s - 5), (b, n), replace=False), axis=1),
                 keep=np.ones((b, n), bool))
    results = {}
    for attention in ("einsum", "xla"):
        cfg = ConfigDict(dict(experiment.DSPARK_TRAIN, attention=attention))
        results[attention] = jax.value_and_grad(
            lambda p: train_step.loss_fn(p, drafter.graphdef, target.graphdef, target.state,
                                         batch, cfg)[0])(drafter.state)
    (ref_loss, ref_grads), (loss, grads) = results["einsum"], results["xla"]
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    jax.tree.map(lambda a, r: np.testing.assert_allclose(a, r, rtol=1e-4, atol=1e-6), grads, ref_grads)


def _cache_attention_args(rng, t, b=4, n=64, h=6, kv=2, d=16):
    """attend_cache's arguments over an untransposed cache of ``n`` slots: rows whose committed
    lengths are none, one, some and all of the slots, and new tokens that see themselves and
    some of the earlier new tokens."""
    q = jnp.asarray(rng.normal(size=(b, t, h, d)), jnp.float32)
    k_cache, v_cache = (jnp.asarray(rng.normal(size=(b, kv, n, d)), jnp.float32) for _ in range(2))
    k_new, v_new = (jnp.asarray(rng.normal(size=(b, t, kv, d)), jnp.float32) for _ in range(2))
    lengths = jnp.asarray([0, 1, 37, n][:b], jnp.int32)
    cache_visible = jnp.broadcast_to(jnp.arange(n)[None, None] < lengths[:, None, None], (b, t, n))
    new_visible = np.tril(np.ones((t, t), bool)) & (rng.random((b, t, t)) < 0.7)
    new_visible |= np.eye(t, dtype=bool)
    return (q, k_cache, v_cache, cache_visible, k_new, v_new, jnp.asarray(new_visible)), lengths


@pytest.mark.parametrize("t, dtype, atol", [(1, jnp.float32, 2e-5), (5, jnp.float32, 2e-5),
                                            (5, jnp.bfloat16, 3e-2)])
def test_the_pallas_cache_kernel_equals_the_einsum(t, dtype, atol):
    """A decode step (T = 1) and a verify (T = 5) over the cache through the Pallas decode
    kernel (interpret mode on a CPU) equal the einsum, including a row with nothing cached;
    in bfloat16 (the accelerators' dtype) against the float32 einsum of the same inputs."""
    args, lengths = _cache_attention_args(np.random.default_rng(5), t)
    args = tuple(a.astype(dtype) if a.dtype == jnp.float32 else a for a in args)

    def run(impl, *inputs):
        return jax.jit(lambda *a: fused_attention.attend_cache(
            *a, lengths=lengths, scale=0.3, transposed_keys=False, implementation=impl))(*inputs)

    assert "pallas_call" in str(jax.make_jaxpr(lambda *a: run("pallas", *a))(*args))
    ref = run("einsum", *(a.astype(jnp.float32) if a.dtype == dtype else a for a in args))
    out = run("pallas", *args)
    assert out.dtype == dtype and np.abs(np.asarray(ref)).max() > 0.1
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref), atol=atol)


def test_the_pallas_cache_kernel_applies_only_where_it_can():
    """Keys in the CPU's transposed layout, a sliding window (no lengths), a cache length or
    head dim that Triton's power-of-two blocks cannot tile: the einsum, not the kernel."""
    rng = np.random.default_rng(6)
    args, lengths = _cache_attention_args(rng, 2)
    q, k_cache, v_cache, visible, k_new, v_new, new_visible = args

    def kernel_used(*a, **kw):
        fn = lambda *x: fused_attention.attend_cache(*x, implementation="pallas", **kw)  # noqa: E731
        return "pallas_call" in str(jax.make_jaxpr(fn)(*a))

    assert kernel_used(*args, lengths=lengths, transposed_keys=False)
    transposed = (q, k_cache.swapaxes(2, 3), v_cache, visible, k_new, v_new, new_visible)
    assert not kernel_used(*transposed, lengths=lengths, transposed_keys=True)
    assert not kernel_used(*args, lengths=None, transposed_keys=False)
    odd = (q, k_cache[:, :, :40], v_cache[:, :, :40], visible[..., :40], k_new, v_new, new_visible)
    assert not kernel_used(*odd, lengths=jnp.minimum(lengths, 40), transposed_keys=False)
    assert kernel_used(*args, lengths=jnp.minimum(lengths, 32), transposed_keys=False, view=32)
    assert [fused_attention.pallas_cache_split(64, d) for d in (8, 12, 1024)] == [None] * 3
    assert [fused_attention.pallas_cache_split(n, 64) for n in (16, 128, 512, 736, 8192, 16016)] == [
        16, 16, 32, 32, 512, None]  # 16,016 = 1,001 programs of 16 slots
    with pytest.raises(ValueError, match="unknown cache attention implementation 'paged'"):
        fused_attention.attend_cache(*args, implementation="paged")


def test_a_verify_through_the_pallas_cache_kernel_equals_the_einsum():
    """The whole decoder: a prefill into an untransposed cache, then a verify of 4 tokens per
    row through the kernel, against the CPU's transposed cache and the einsum."""
    from dspark_jax.models.kv_cache import KVCache

    config = dict(QWEN3, head_dim=16)
    model = init_target({k: v for k, v in config.items() if v is not None}, seed=4).model
    rng = np.random.default_rng(7)
    rows, slots, t = 3, 64, 4
    history = jnp.asarray(rng.integers(0, 64, (rows, slots)))
    starts = np.array([0, 21, slots - t])
    new = jnp.asarray(rng.integers(0, 64, (rows, t)))
    positions = jnp.asarray(starts[:, None] + np.arange(t))

    def verify(transposed_keys, impl):
        cache = KVCache.for_model(model.config, rows, slots, jnp.float32, transposed_keys)
        cache = model(history, jnp.broadcast_to(jnp.arange(slots), (rows, slots)), cache=cache).cache
        out = jax.jit(lambda c, x, p: model(x, p, cache=c, cache_attention=impl, tap_layer_ids=(1,)))(
            cache, new, positions)
        keys = out.cache.k if transposed_keys else out.cache.k.swapaxes(-1, -2)
        return out.hidden, out.taps, keys, out.cache.v

    ref, got = verify(True, "einsum"), verify(False, "pallas")
    for want, have in zip(ref, got, strict=True):
        np.testing.assert_allclose(np.asarray(have), np.asarray(want), atol=1e-4)


MESH_SCRIPT = textwrap.dedent(r'''
    import json
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding
    from dspark_jax.models import fused_attention
    from dspark_jax.sharding import logical_to_spec, make_mesh

    assert len(jax.devices()) == 8
    rng = np.random.default_rng(8)
    b, t, n, h, kv, d = 4, 3, 64, 6, 2, 16
    lengths = jnp.asarray([0, 1, 37, n], jnp.int32)
    new_visible = np.tril(np.ones((t, t), bool)) & (rng.random((b, t, t)) < 0.7) | np.eye(t, dtype=bool)
    args = dict(q=rng.normal(size=(b, t, h, d)), k_cache=rng.normal(size=(b, kv, n, d)),
                v_cache=rng.normal(size=(b, kv, n, d)),
                cache_visible=np.arange(n)[None, None] < np.asarray(lengths)[:, None, None],
                k_new=rng.normal(size=(b, t, kv, d)), v_new=rng.normal(size=(b, t, kv, d)),
                new_visible=new_visible)
    names = dict(q=("batch", None, "q_heads", None), k_cache=("batch", "kv_heads", None, None),
                 v_cache=("batch", "kv_heads", None, None), cache_visible=("batch", None, None),
                 k_new=("batch", None, "kv_heads", None), v_new=("batch", None, "kv_heads", None),
                 new_visible=("batch", None, None))
    args = {k: jnp.asarray(a, jnp.float32 if a.dtype == np.float64 else a.dtype) for k, a in args.items()}

    def attend(impl):
        return jax.jit(lambda a: fused_attention.attend_cache(
            **a, lengths=lengths, transposed_keys=False, implementation=impl))

    ref = np.asarray(attend("einsum")(args))
    report = {}
    for shape in [(4, 1, 2), (2, 2, 2), (1, 1, 8)]:
        mesh = make_mesh(shape)
        with jax.set_mesh(mesh):
            placed = {k: jax.device_put(a, NamedSharding(mesh, logical_to_spec(names[k], a.shape, mesh)))
                      for k, a in args.items()}
            jaxpr = str(jax.make_jaxpr(attend("pallas"))(placed))
            out = np.asarray(attend("pallas")(placed))
        report[str(shape)] = dict(per_shard="shard_map" in jaxpr and "pallas_call" in jaxpr,
                                  max_diff=float(np.abs(out - ref).max()))
    print("REPORT " + json.dumps(report))
''')


def test_the_pallas_cache_kernel_runs_per_shard_under_a_mesh():
    """Under meshes of 8 simulated devices the kernel runs on each device's rows and kv heads
    (shard_map), the cache placed as the logical axis rules place it: rows over data (and fsdp)
    and kv heads over tensor, or kept whole where they do not divide (8 devices, 2 kv heads).
    Equal to the einsum without a mesh."""
    report = run_on_cpu_devices(["-c", MESH_SCRIPT])
    assert set(report) == {"(4, 1, 2)", "(2, 2, 2)", "(1, 1, 8)"}
    for shape, result in report.items():
        assert result["per_shard"], shape
        assert result["max_diff"] < 2e-5, (shape, result)
