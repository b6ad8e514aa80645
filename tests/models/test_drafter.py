"""Tests of the DSpark drafting backbone, its training forward and the drafter config."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import dspark_jax
from dspark_jax.drafter_config import default_layer_ids, drafter_config
from dspark_jax.models import cpu_attention
from dspark_jax.models.drafter import block_attention_mask, sample_anchors
from dspark_jax.models.heads import block_bias
from dspark_jax.target import init_target

TINY = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=2, head_dim=8)
CONFIGS = Path(__file__).resolve().parents[2] / "configs"


@pytest.fixture(scope="module", params=["Qwen3ForCausalLM", "LlamaForCausalLM", "head-dim-16"])
def target(request):
    """Tiny targets; with a head dim of 16 a CPU drafts through the cache attention kernel
    (``cpu_attention``), with 8 through the einsum."""
    if request.param == "head-dim-16":
        return init_target(dict(architectures=["Qwen3ForCausalLM"], **dict(TINY, head_dim=16)),
                           seed=1)
    return init_target(dict(architectures=[request.param], **TINY), seed=1)


@pytest.fixture(scope="module")
def qwen3():
    return init_target(dict(architectures=["Qwen3ForCausalLM"], **TINY), seed=1)


def _taps(target, ids, layer_ids):
    model = target.model
    positions = jnp.broadcast_to(jnp.arange(ids.shape[1]), ids.shape)
    return model(ids, positions, tap_layer_ids=tuple(layer_ids)).taps


def test_training_forward_matches_inference(target):
    """Teacher-forced blocks equal inference blocks fed the same context (fresh, incremental
    and with stale cache slots beyond the anchor)."""
    drafter = dspark_jax.init_drafter(target, head="rnn", markov_rank=8, seed=3)
    cfg, model, tmodel = drafter.config, drafter.model, target.model
    seq = 14
    ids = jax.random.randint(jax.random.key(0), (1, seq), 0, 64)
    taps = _taps(target, ids, cfg.target_layer_ids)
    anchors = jnp.array([[2, 6, 9]])
    train = jax.jit(lambda m, t: m.forward_train(
        t, input_ids=ids, taps=taps, anchors=anchors, keep=jnp.ones((1, 3), bool),
        loss_mask=jnp.ones((1, seq), bool)))(model, tmodel)
    assert np.isfinite(np.asarray(train.hidden)).all()

    draft = jax.jit(lambda m, t, **kw: m.draft(t, **kw))
    slots = 16

    def infer(cache, start, stop, anchor):
        # Always all 14 taps (one compile); positions outside [start, stop) are padding.
        index = jnp.arange(seq)
        positions = jnp.where((index >= start) & (index < stop), index, slots)[None]
        return draft(model, tmodel, ctx_taps=taps, ctx_positions=positions, cache=cache,
                     anchor_tokens=ids[:, anchor], anchor_positions=jnp.array([anchor]))

    kernel = target.config.head_dim % 16 == 0 and cpu_attention.available()
    program = draft.lower(model, tmodel, ctx_taps=taps, ctx_positions=jnp.zeros((1, seq), jnp.int32),
                          cache=model.init_cache(1, slots), anchor_tokens=ids[:, 2],
                          anchor_positions=jnp.array([2])).as_text()
    assert (cpu_attention.TARGET in program) == kernel
    # Fresh cache per anchor.
    for j, a in enumerate([2, 6, 9]):
        out = infer(model.init_cache(1, slots), 0, a, a)
        np.testing.assert_allclose(out.hidden[0], train.hidden[0, j], atol=2e-5, rtol=2e-5)
    # Incremental: the second call only brings the context between the two anchors.
    first = infer(model.init_cache(1, slots), 0, 2, 2)
    second = infer(first.cache, 2, 6, 6)
    np.testing.assert_allclose(second.hidden[0], train.hidden[0, 1], atol=2e-5, rtol=2e-5)
    # Stale slots: the cache holds all 14 positions; the anchor at 6 must ignore slots >= 6.
    full = infer(model.init_cache(1, slots), 0, seq, seq - 1)
    pad = infer(full.cache, 0, 0, 6)
    np.testing.assert_allclose(pad.hidden[0], train.hidden[0, 1], atol=2e-5, rtol=2e-5)
    np.testing.assert_array_equal(pad.cache.k, full.cache.k)  # padding entries are dropped


def test_draft_cache_layouts_agree(qwen3):
    """A draft context cache with keys stored like values (the accelerators' layout) drafts
    the same blocks as the CPU's transposed layout, and holds the same entries."""
    drafter = dspark_jax.init_drafter(qwen3, head="rnn", markov_rank=8, seed=3)
    model, tmodel = drafter.model, qwen3.model
    ids = jax.random.randint(jax.random.key(1), (2, 12), 0, 64)
    taps = _taps(qwen3, ids, drafter.config.target_layer_ids)
    positions = jnp.broadcast_to(jnp.arange(12), (2, 12)).at[1, 9:].set(16)  # row 1: 9 tokens
    draft = jax.jit(lambda m, t, c: m.draft(t, ctx_taps=taps, ctx_positions=positions, cache=c,
                                            anchor_tokens=ids[:, 8], anchor_positions=jnp.array([11, 8])))
    ref = draft(model, tmodel, model.init_cache(2, 16, transposed_keys=True))
    out = draft(model, tmodel, model.init_cache(2, 16, transposed_keys=False))
    np.testing.assert_allclose(out.hidden, ref.hidden, atol=1e-5, rtol=1e-5)
    np.testing.assert_array_equal(out.cache.k, ref.cache.k.swapaxes(-1, -2))
    np.testing.assert_array_equal(out.cache.v, ref.cache.v)


def test_training_labels_prev_logits_and_confidence(qwen3):
    drafter = dspark_jax.init_drafter(qwen3, block_size=4, markov_rank=8, seed=0)
    model = drafter.model
    cfg = drafter.config
    ids = jnp.arange(10)[None] + 20
    loss_mask = jnp.array([[0, 1, 1, 1, 1, 1, 0, 1, 1, 1]], bool)
    taps = _taps(qwen3, ids, cfg.target_layer_ids)

    @jax.jit
    def forward(model, target, anchors, keep):
        out = model.forward_train(target, input_ids=ids, taps=taps, anchors=anchors, keep=keep,
                                  loss_mask=loss_mask)
        return out, target.logits(out.hidden) + block_bias(model.markov_head, out.prev, out.hidden)

    out, expected = forward(model, qwen3.model, jnp.array([[1, 7, 0]]),
                            jnp.array([[True, True, False]]))
    np.testing.assert_array_equal(out.labels[0, 0], [22, 23, 24, 25])
    np.testing.assert_array_equal(out.prev[0, 0], [21, 22, 23, 24])
    # Block at 1: labels at 2..5, all in the loss mask. Block at 7: labels 8, 9, then out of
    # range. The dummy block has nothing.
    np.testing.assert_array_equal(out.eval_mask[0], [[1, 1, 1, 1], [1, 1, 0, 0], [0, 0, 0, 0]])
    assert np.isfinite(np.asarray(out.hidden)).all()  # the dummy block sees no context: no NaN
    np.testing.assert_allclose(out.logits, expected, atol=1e-5)
    assert out.confidence.shape == (1, 3, 4) and out.confidence.dtype == jnp.float32
    # The loss mask gap at 6 cuts a block's prefix: anchor 4 -> labels 5, 6 -> [1, 0, 0, 0].
    cut, _ = forward(model, qwen3.model, jnp.array([[4, 1, 7]]), jnp.array([[True, True, True]]))
    np.testing.assert_array_equal(cut.eval_mask[0, 0], [1, 0, 0, 0])


def test_dflash_slots_predict_their_own_position(qwen3):
    """anchor_predicts=False (z-lab DFlash): slot k predicts position anchor + k, slot 0 none."""
    drafter = dspark_jax.init_drafter(qwen3, block_size=4, head="none", anchor_predicts=False,
                                      confidence_head=False)
    ids = jnp.arange(10)[None] + 20
    taps = _taps(qwen3, ids, drafter.config.target_layer_ids)
    out = drafter.model.forward_train(qwen3.model, input_ids=ids, taps=taps,
                                      anchors=jnp.array([[2]]), keep=jnp.array([[True]]),
                                      loss_mask=jnp.ones((1, 10), bool))
    np.testing.assert_array_equal(out.labels[0, 0, 1:], [23, 24, 25])
    np.testing.assert_array_equal(out.eval_mask[0, 0], [0, 1, 1, 1])
    assert out.confidence is None and drafter.model.markov_head is None


def test_block_mask_with_segments():
    anchors, keep = jnp.array([[2, 5]]), jnp.array([[True, True]])
    segments = jnp.array([[0, 0, 0, 0, 1, 1, 1]])
    mask = block_attention_mask(anchors=anchors, keep=keep, context_len=7, block_size=2,
                                segment_ids=segments).dense(2)
    assert mask.shape == (1, 4, 7 + 4)
    np.testing.assert_array_equal(mask[0, 0, :7], [1, 1, 0, 0, 0, 0, 0])
    np.testing.assert_array_equal(mask[0, 2, :7], [0, 0, 0, 0, 1, 0, 0])  # segment 1 only
    np.testing.assert_array_equal(mask[0, :, 7:], [[1, 1, 0, 0], [1, 1, 0, 0],
                                                   [0, 0, 1, 1], [0, 0, 1, 1]])


def test_blockwise_attention_equals_dense_attention():
    from dspark_jax.models.layers import attend, attend_blockwise

    b, n, bs, s, h, kv, d = 2, 3, 4, 5, 4, 2, 8
    keys = jax.random.split(jax.random.key(0), 8)
    q = jax.random.normal(keys[0], (b, n * bs, h, d))
    k_ctx, v_ctx = (jax.random.normal(keys[i], (b, s, kv, d)) for i in (1, 2))
    k_blk, v_blk = (jax.random.normal(keys[i], (b, n * bs, kv, d)) for i in (3, 4))
    anchors = jnp.array([[1, 3, 4], [0, 2, 5]])
    keep = jnp.array([[True, True, False], [True, True, True]])  # a dummy block; anchor 0
    mask = block_attention_mask(anchors=anchors, keep=keep, context_len=s, block_size=bs)
    dense = attend(q, jnp.concatenate([k_ctx, k_blk], 1), jnp.concatenate([v_ctx, v_blk], 1),
                   mask.dense(bs))
    # The context in the cache layout: keys [b, K, D, s], values [b, K, s, D].
    blockwise = attend_blockwise(q, k_ctx.transpose(0, 2, 3, 1), v_ctx.swapaxes(1, 2), mask.context,
                                 k_blk, v_blk, mask.keep, block_size=bs)
    np.testing.assert_allclose(blockwise, dense, atol=1e-5, rtol=1e-5)
    assert not np.asarray(blockwise[0, 2 * bs:]).any()  # the dummy block sees nothing


def test_sample_anchors():
    loss_mask = jnp.array([[0, 1, 1, 1, 0, 1, 1, 0], [0, 0, 0, 0, 0, 0, 1, 1]])
    anchors, keep = sample_anchors(jax.random.key(0), loss_mask, 4)
    np.testing.assert_array_equal(keep, [[1, 1, 1, 0], [1, 0, 0, 0]])
    np.testing.assert_array_equal(anchors[0, :3], [1, 2, 5])
    np.testing.assert_array_equal(anchors[1], [6, 0, 0, 0])


class _Tokenizer:
    def __init__(self, size):
        self.size = size

    def __len__(self):
        return self.size


def test_default_config_from_target():
    assert default_layer_ids(36) == (1, 9, 17, 25, 33)
    assert default_layer_ids(40) == (1, 10, 19, 28, 37)
    for layers in (2, 3, 4, 7, 30):
        ids = default_layer_ids(layers)
        assert max(ids) <= layers - 2 and len(ids) == len(set(ids))
    spare = init_target(dict(architectures=["Qwen3ForCausalLM"], **TINY), tokenizer=_Tokenizer(60))
    cfg = dspark_jax.init_drafter(spare).config
    assert (cfg.mask_token_id, cfg.trainable_mask_embedding) == (60, False)
    full = init_target(dict(architectures=["LlamaForCausalLM"], **TINY), tokenizer=_Tokenizer(64))
    drafter = dspark_jax.init_drafter(full)
    assert drafter.config.trainable_mask_embedding and drafter.model.mask_embedding is not None


def test_overrides_and_errors(qwen3):
    d = dspark_jax.init_drafter(qwen3, block_size=3, num_layers=1, head="gated", markov_rank=4,
                                target_layer_ids=(0, 2), mask_token_id=5)
    shapes = {tuple(map(str, p)): v.get_value().shape for p, v in nnx.to_flat_state(d.state)}
    assert shapes[("markov_head", "gate_proj", "kernel")] == (32 + 4, 4)
    assert shapes[("fc", "kernel")] == (2 * 32, 32)
    assert shapes[("layers", "self_attn", "q_proj", "kernel")] == (1, 32, 32)
    base = dspark_jax.init_drafter(qwen3, head="none")
    assert base.config.markov_rank == 0 and base.model.markov_head is None
    assert base.model.confidence_head.proj.kernel.get_value().shape == (32, 1)
    with pytest.raises(ValueError, match="out of range"):
        dspark_jax.init_drafter(qwen3, target_layer_ids=(0, 3))
    with pytest.raises(ValueError, match="unknown drafter config field"):
        dspark_jax.init_drafter(qwen3, rank=3)
    with pytest.raises(ValueError, match="unknown head"):
        dspark_jax.init_drafter(qwen3, head="lstm")
    with pytest.raises(ValueError, match="needs markov_rank > 0"):
        drafter_config(head="rnn", markov_rank=0, target_layer_ids=(0,), mask_token_id=1)


@pytest.mark.parametrize("name", sorted(p.stem for p in CONFIGS.glob("*.py")))
def test_reference_configs_validate(name):
    spec = importlib.util.spec_from_file_location(name, CONFIGS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    config = module.get_config()
    cfg = drafter_config(**config.drafter.to_dict())
    assert cfg.block_size == 7
    if name.startswith("dflash"):
        assert (cfg.markov_rank, cfg.head, cfg.confidence_head) == (0, "none", False)
    if "qwen3" in name:
        assert (cfg.num_layers, cfg.mask_token_id) == (5, 151669)
