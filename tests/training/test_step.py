"""The train step: packing, masks, gradient accumulation, optimisation, sharding."""

from __future__ import annotations

import os
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import run_on_cpu_devices
from flax import nnx
from ml_collections import ConfigDict

import dspark_jax
from dspark_jax import experiment, sharding
from dspark_jax.models import fused_attention
from dspark_jax.models.drafter import block_attention_mask
from dspark_jax.target import init_target
from dspark_jax.training import step as train_step

TINY = dict(architectures=["Qwen3ForCausalLM"], vocab_size=64, hidden_size=32, intermediate_size=64,
            num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=8)
CFG = ConfigDict(dict(experiment.DSPARK_TRAIN, learning_rate=3e-3, warmup_ratio=0.0))

def random_sequence(rng, length, vocab=64, prompt=2, num_anchors=2):
    """(ids, loss_mask, anchors): a prompt of ``prompt`` tokens, then loss tokens; anchors are
    sorted candidates (loss_mask[i] & loss_mask[i + 1]), the last one at the final candidate
    so its block runs past the end of the sequence."""
    ids = rng.integers(0, vocab, length)
    mask = (np.arange(length) >= prompt).astype(np.int32)
    candidates = np.arange(prompt, length - 1)
    anchors = np.sort(np.append(rng.choice(candidates[:-1], num_anchors - 1, replace=False),
                                candidates[-1]))
    return ids, mask, anchors


def make_batch(rows, row_len, num_anchors):
    """rows: lists of (ids, loss_mask, anchors) sequences packed into each row -> batch dict."""
    b = len(rows)
    batch = dict(input_ids=np.zeros((b, row_len), np.int32), positions=np.zeros((b, row_len), np.int32),
                 segment_ids=np.zeros((b, row_len), np.int32), loss_mask=np.zeros((b, row_len), np.int32),
                 anchors=np.zeros((b, num_anchors), np.int32), keep=np.zeros((b, num_anchors), bool))
    for r, row in enumerate(rows):
        offset, anchors = 0, []
        for s, (ids, mask, seq_anchors) in enumerate(row):
            span = slice(offset, offset + len(ids))
            batch["input_ids"][r, span], batch["loss_mask"][r, span] = ids, mask
            batch["positions"][r, span], batch["segment_ids"][r, span] = np.arange(len(ids)), s + 1
            anchors += [a + offset for a in seq_anchors]
            offset += len(ids)
        batch["anchors"][r, :len(anchors)], batch["keep"][r, :len(anchors)] = anchors, True
    return batch


def smooth_optimizer():
    """Clipped AdamW whose update is smooth in the gradient (eps 1e-3), for exact comparisons."""
    return optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(3e-3, eps=1e-3, weight_decay=0.01))


def _scaled(state, factor):
    """Larger weights than the N(0, 0.02) init, so that distributions are far from uniform."""
    return jax.tree.map(lambda x: x * factor, state)


@pytest.fixture(scope="module")
def models():
    target = init_target(TINY, seed=1)
    target.state = _scaled(target.state, 6.0)
    drafter = dspark_jax.init_drafter(target, seed=2, num_layers=1, markov_rank=8, block_size=4)
    drafter.state = _scaled(drafter.state, 6.0)
    return target, drafter


@pytest.fixture(scope="module")
def loss_fn(models):
    """Jitted (batch -> (loss, sums)) of the float32 drafter."""
    target, drafter = models
    fn = jax.jit(lambda p, t, b: train_step.loss_fn(p, drafter.graphdef, target.graphdef, t, b, CFG))
    return lambda batch: fn(drafter.state, target.state, batch)


def _three_sequences(seed):
    rng = np.random.default_rng(seed)
    return [random_sequence(rng, n) for n in (7, 10, 6)]


def test_packed_rows_equal_one_sequence_per_row(loss_fn):
    seqs = _three_sequences(0)
    loss, sums = loss_fn(make_batch([[s] for s in seqs], row_len=10, num_anchors=2))
    packed_loss, packed_sums = loss_fn(make_batch([seqs], row_len=24, num_anchors=7))
    assert float(sums["tokens"]) >= 12 and float(sums["blocks"]) == 6
    assert 0.02 < float(sums["accept"].sum() / sums["tokens"]) < 0.9  # far from uniform
    np.testing.assert_allclose(packed_loss, loss, rtol=1e-5)
    for key in sums:
        np.testing.assert_allclose(packed_sums[key], sums[key], rtol=1e-5, atol=1e-6, err_msg=key)


def test_masks_never_cross_segments():
    rng = np.random.default_rng(1)
    segment_ids = np.array([[1] * 5 + [2] * 7 + [3] * 2 + [0] * 2, [1] * 16, [1] * 9 + [2] * 5 + [0] * 2])
    seq = segment_ids.shape[1]
    q, k = np.arange(seq)[:, None], np.arange(seq)[None, :]
    same = (segment_ids[:, :, None] == segment_ids[:, None, :]) & (segment_ids[:, None, :] != 0)
    np.testing.assert_array_equal(fused_attention.segment_mask(jnp.asarray(segment_ids)),
                                  same & (k <= q)[None])

    block, num_anchors = 3, 4
    candidates = [np.flatnonzero(row[:-1] == row[1:]) for row in segment_ids]
    anchors = np.stack([np.sort(rng.choice(c, num_anchors, replace=False)) for c in candidates])
    keep = np.array([[1, 1, 1, 1], [1, 1, 0, 0], [1, 1, 1, 0]], bool)
    mask = np.asarray(block_attention_mask(anchors=jnp.asarray(anchors), keep=jnp.asarray(keep),
                                           context_len=seq, block_size=block,
                                           segment_ids=jnp.asarray(segment_ids)).dense(block))
    query_anchor = np.repeat(anchors, block, axis=1)  # [b, N*B]
    query_block = np.arange(num_anchors * block) // block
    anchor_segment = np.take_along_axis(segment_ids, query_anchor, 1)
    context = ((segment_ids[:, None, :] == anchor_segment[:, :, None]) & (anchor_segment[:, :, None] != 0)
               & (k[None] < query_anchor[:, :, None]))
    own_block = np.broadcast_to(query_block[:, None] == query_block[None, :], (3,) + (len(query_block),) * 2)
    expected = np.concatenate([context, own_block], -1) & np.repeat(keep, block, 1)[:, :, None]
    np.testing.assert_array_equal(mask, expected)
    assert mask[:, :, :seq].any()


def test_bfloat16_compute_keeps_float32_gradients(models, loss_fn):
    target, drafter = models
    batch = make_batch([[s] for s in _three_sequences(2)], row_len=10, num_anchors=2)
    ref, _ = loss_fn(batch)
    fn = jax.jit(jax.value_and_grad(lambda p: train_step.loss_fn(
        p, drafter.graphdef, target.graphdef, target.state, batch, CFG, compute_dtype=jnp.bfloat16)[0]))
    loss, grads = fn(drafter.state)
    assert all(g.dtype == jnp.float32 and np.isfinite(g).all() for g in jax.tree.leaves(grads))
    np.testing.assert_allclose(loss, ref, rtol=5e-2)


def test_compute_dtype_is_the_configs_or_the_backends():
    from dspark_jax.training.trainer import compute_dtype

    assert compute_dtype(ConfigDict(dict(compute_dtype=""))) == jnp.float32  # CPU's default
    assert compute_dtype(ConfigDict(dict(compute_dtype="bfloat16"))) == jnp.bfloat16
    assert compute_dtype(ConfigDict(dict(compute_dtype="float32"))) == jnp.float32
    with pytest.raises(ValueError, match="train.compute_dtype 'float16'"):
        compute_dtype(ConfigDict(dict(compute_dtype="float16")))


def test_learning_rate_schedule():
    schedule = train_step.learning_rate_schedule(ConfigDict(dict(learning_rate=1.0, warmup_ratio=0.2)), 10)
    np.testing.assert_allclose([schedule(t) for t in (0, 1, 2, 6, 10, 12)], [0.5, 1, 1, 0.5, 0, 0],
                               atol=1e-6)


def test_optimizer_clips_warms_up_and_decays():
    """First AdamW update: -lr(0) * (g / |g|) - lr(0) * wd * p, whatever the gradient norm."""
    cfg = ConfigDict(dict(CFG, learning_rate=1e-2, warmup_ratio=0.5, weight_decay=0.1))
    optimizer = train_step.make_optimizer(cfg, total_steps=4)
    params = {"w": jnp.array([1.0, -2.0, 3.0])}
    grads = {"w": jnp.array([300.0, -40.0, 5.0])}
    updates, _ = optimizer.update(grads, optimizer.init(params), params)
    lr = 1e-2 / 2
    np.testing.assert_allclose(updates["w"], -lr * np.sign(grads["w"]) - lr * 0.1 * params["w"], rtol=1e-4)


# ----------------------------------------------------------------------------- the jitted step


@pytest.fixture(scope="module")
def step_setup(models):
    """(batch, optimizer, mesh, {grad_accum_steps: jitted step}) on one device.

    AdamW with a large eps: a plain first Adam step is lr * sign(g), which turns rounding-level
    differences of near-zero gradients into lr-sized parameter differences.
    """
    target, drafter = models
    rng = np.random.default_rng(3)
    batch = make_batch([[random_sequence(rng, n) for n in (9, 7)] for _ in range(4)], 16, 4)
    optimizer = smooth_optimizer()
    mesh = sharding.make_mesh((1, 1, 1), devices=jax.devices()[:1])
    example = jax.eval_shape(lambda s: train_step.init_train_state(s, optimizer), drafter.state)
    steps = {accum: train_step.make_train_step(drafter.graphdef, target.graphdef, CFG, optimizer,
                                               mesh=mesh, state=example, target_state=target.state,
                                               grad_accum_steps=accum)
             for accum in (1, 2)}
    return batch, optimizer, mesh, steps


@pytest.mark.slow  # two train-step programs
def test_gradient_accumulation_equals_one_batch(models, step_setup):
    target, drafter = models
    batch, optimizer, mesh, steps = step_setup
    results = [steps[accum](train_step.init_train_state(drafter.state, optimizer, mesh), target.state, batch)
               for accum in (1, 2)]
    (one, one_metrics), (two, two_metrics) = results
    for key in one_metrics:
        np.testing.assert_allclose(two_metrics[key], one_metrics[key], rtol=1e-5, atol=1e-6, err_msg=key)
    assert int(one.step) == int(two.step) == 1
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5), two.params, one.params)


def test_steps_reduce_loss_and_leave_target_frozen(models, step_setup):
    target, drafter = models
    batch, optimizer, mesh, steps = step_setup
    target_before = jax.tree.map(np.array, target.state)
    state = train_step.init_train_state(drafter.state, optimizer, mesh)
    paths = ["/".join(map(str, p)) for p, _ in nnx.to_flat_state(state.params)]
    assert "mask_embedding" in paths and not any("embed_tokens" in p or "lm_head" in p for p in paths)
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(state.params))
    losses = []
    for _ in range(4):
        state, metrics = steps[1](state, target.state, batch)
        losses.append(float(metrics["loss"]))
    assert losses[-1] < losses[0] - 0.01, losses
    assert np.isfinite(float(metrics["grad_norm"]))
    jax.tree.map(np.testing.assert_array_equal, target.state, target_before)
    jax.tree.map(lambda new, old: np.testing.assert_(np.any(new != old)), state.params, drafter.state)


GEMMA3 = dict(TINY, architectures=["Gemma3ForCausalLM"], sliding_window=3,
              final_logit_softcapping=5.0, layer_types=["sliding_attention", "full_attention"] * 2)
GEMMA4 = dict(GEMMA3, architectures=["Gemma4ForCausalLM"], global_head_dim=16,
              num_global_key_value_heads=1, attention_k_eq_v=True, hidden_size_per_layer_input=0)


@pytest.mark.parametrize("config", [GEMMA3, GEMMA4], ids=["gemma3", "gemma4"])
def test_a_drafter_trains_on_a_gemma_target(config):
    """Packed rows over a Gemma target: sliding layers with a 3-token window (shorter than the
    sequences), logits soft-capped at 5 (Gemma4: full layers of their own shape, which the draft
    layers take); the loss falls and the target stays frozen."""
    target = init_target(config, seed=1)
    target.state = _scaled(target.state, 6.0)
    drafter = dspark_jax.init_drafter(target, seed=2, num_layers=1, markov_rank=8, block_size=4)
    assert drafter.model.model_config.layer_types == ("full_attention",)
    rng = np.random.default_rng(3)
    batch = make_batch([[random_sequence(rng, n) for n in (9, 7)] for _ in range(4)], 16, 4)
    optimizer = smooth_optimizer()
    mesh = sharding.make_mesh((1, 1, 1), devices=jax.devices()[:1])
    example = jax.eval_shape(lambda s: train_step.init_train_state(s, optimizer), drafter.state)
    step = train_step.make_train_step(drafter.graphdef, target.graphdef, CFG, optimizer, mesh=mesh,
                                      state=example, target_state=target.state)
    target_before = jax.tree.map(np.array, target.state)
    state = train_step.init_train_state(drafter.state, optimizer, mesh)
    losses = []
    for _ in range(4):
        state, metrics = step(state, target.state, batch)
        losses.append(float(metrics["loss"]))
    assert losses[-1] < losses[0] - 0.01, losses
    jax.tree.map(np.testing.assert_array_equal, target.state, target_before)


# ----------------------------------------------------------------------------- sharding

SHARDED_SCRIPT = textwrap.dedent(r'''
    import json
    import os
    import sys
    import jax
    import numpy as np
    from flax import nnx
    from ml_collections import ConfigDict
    import dspark_jax
    from dspark_jax import experiment, sharding
    from dspark_jax.target import init_target
    from dspark_jax.training import step as train_step

    sys.path[:0] = [sys.argv[1], os.path.dirname(sys.argv[1])]  # test_step and conftest
    from test_step import make_batch, random_sequence, smooth_optimizer

    assert len(jax.devices()) == 8
    TINY = dict(architectures=["Qwen3ForCausalLM"], vocab_size=64, hidden_size=32,
                intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
                num_key_value_heads=2, head_dim=8)
    CFG = ConfigDict(dict(experiment.DSPARK_TRAIN, learning_rate=3e-3, warmup_ratio=0.0))
    target = init_target(TINY, seed=1)
    drafter = dspark_jax.init_drafter(target, seed=2, num_layers=1, markov_rank=8, block_size=4)
    rng = np.random.default_rng(4)
    batch = make_batch([[random_sequence(rng, n) for n in (9, 7)] for _ in range(8)], 16, 4)
    optimizer = smooth_optimizer()

    def run(shape, devices, accum):
        mesh = sharding.make_mesh(shape, devices=devices)
        state = train_step.init_train_state(drafter.state, optimizer, mesh)
        target_state = jax.device_put(target.state, train_step.tree_shardings(target.state, mesh))
        step = train_step.make_train_step(drafter.graphdef, target.graphdef, CFG, optimizer, mesh=mesh,
                                          state=state, target_state=target_state,
                                          grad_accum_steps=accum)
        losses = []
        for _ in range(3):
            state, metrics = step(state, target_state, batch)
            losses.append(float(metrics["loss"]))
        params = {"/".join(map(str, p)): np.asarray(v[...]) for p, v in nnx.to_flat_state(state.params)}
        kernel = state.params["layers"]["mlp"]["up_proj"]["kernel"][...]
        return losses, params, (str(kernel.sharding.spec), len(kernel.sharding.device_set))

    ref_losses, ref_params, _ = run((1, 1, 1), jax.devices()[:1], 1)
    report = {"reference_losses": ref_losses}
    for shape, accum in [((8, 1, 1), 1), ((2, 4, 1), 1), ((2, 2, 2), 2)]:
        losses, params, spec = run(shape, jax.devices(), accum)
        report[str(shape)] = dict(
            losses=losses, spec=spec[0], devices=spec[1],
            loss_rel=max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses)),
            params_close=all(np.allclose(params[k], ref_params[k], rtol=1e-5, atol=1e-5) for k in ref_params),
            params_max_diff=max(float(np.abs(params[k] - ref_params[k]).max()) for k in ref_params))
    print("REPORT " + json.dumps(report))
''')


@pytest.mark.slow  # 8 simulated devices; CI runs -m slow
def test_sharded_steps_equal_single_device(tmp_path):
    """3 steps on (8,1,1), (2,4,1) and (2,2,2) meshes (the last with 2 micro-batches) of 8
    simulated CPU devices give the single-device losses and parameters."""
    script = tmp_path / "sharded_train_step.py"
    script.write_text(SHARDED_SCRIPT)
    report = run_on_cpu_devices([str(script), os.path.dirname(__file__)])
    ref = report.pop("reference_losses")
    assert ref[-1] < ref[0]
    for shape, result in report.items():
        assert result["loss_rel"] < 1e-5, (shape, result["losses"], ref)
        assert result["params_close"], (shape, result["params_max_diff"])
        assert result["devices"] == 8, shape
    assert "fsdp" in report["(2, 4, 1)"]["spec"] and "tensor" in report["(2, 2, 2)"]["spec"]
