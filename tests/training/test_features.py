"""Target-feature cache: extraction, packing, equality with online features (loss, gradients,
train step, trainer), resumability and mismatch errors. Tiny random Qwen3 target."""

from __future__ import annotations

import json
import shutil
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from ml_collections import ConfigDict

import dspark_jax
from dspark_jax import experiment, sharding
from dspark_jax.cli import main as cli_main
from dspark_jax.target import init_target
from dspark_jax.training import data, features, pipeline
from dspark_jax.training import step as train_step
from dspark_jax.training.trainer import train

TINY = dict(architectures=["Qwen3ForCausalLM"], vocab_size=64, hidden_size=32, intermediate_size=64,
            num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
            eos_token_id=3)
TAPS = (0, 2)
CFG = ConfigDict(dict(experiment.DSPARK_TRAIN, learning_rate=3e-3, warmup_ratio=0.0))
PIPE = dict(batch_size=2, pack_length=48, anchors_per_row=6, anchors_per_sequence=3, block_size=4,
            seed=5)
SHARDS = [(0, 9), (9, 9), (9, 20)]  # sample ranges; the second shard is empty


def write_data(folder, seed=0, num_samples=20, shards=SHARDS):
    """Synthetic samples of 6..40 tokens (prompt of 2..5, then loss tokens) as shards."""
    rng = np.random.default_rng(seed)
    samples = []
    for i in range(num_samples):
        n = int(rng.integers(6, 41))
        mask = (np.arange(n) >= int(rng.integers(2, 6))).astype(np.uint8)
        samples.append((i, rng.integers(4, 64, n).astype(np.int32), mask))
    folder.mkdir(parents=True, exist_ok=True)
    files = []
    for s, (lo, hi) in enumerate(shards):
        name = f"shard_{s:05d}.npz"
        data.write_shard(folder / name, samples[lo:hi])
        files.append(dict(file=name, samples=hi - lo))
    data.write_manifest(folder, dict(files=files, num_samples=num_samples))
    return folder


@pytest.fixture(scope="module")
def models():
    """Target and drafter; the target's LM head and the drafter are scaled up so that the
    distributions are far from uniform (the target's layers are not: float32 rounding stays
    near 1e-6 of the features)."""
    target = init_target(TINY, seed=1)
    target.state = jax.tree_util.tree_map_with_path(
        lambda path, x: x * 8.0 if "lm_head" in jax.tree_util.keystr(path) else x, target.state)
    drafter = dspark_jax.init_drafter(target, seed=2, num_layers=1, markov_rank=8, block_size=4,
                                      target_layer_ids=TAPS)
    drafter.state = jax.tree.map(lambda x: x * 2.0, drafter.state)
    return target, drafter


@pytest.fixture(scope="module")
def cache(models, tmp_path_factory):
    """(data folder, float32 feature cache) of the synthetic samples."""
    target, _ = models
    root = tmp_path_factory.mktemp("features")
    data_dir = write_data(root / "data")
    features.extract_features(target, data_dir, root / "cache", TAPS, batch_size=4,
                              length_multiple=16, progress=False)
    return data_dir, root / "cache"


def batches(data_dir, feature_dir=None, count=3, key=None):
    it = pipeline.make_pipeline(data_dir, feature_dir=feature_dir, feature_key=key, **PIPE)
    return [next(it) for _ in range(count)]


def test_cache_files_and_manifest(models, cache):
    target, _ = models
    data_dir, feature_dir = cache
    manifest = data.load_manifest(feature_dir)
    assert manifest["key"] == features.cache_key(target, TAPS) and manifest["dtype"] == "float32"
    assert [f["samples"] for f in manifest["files"]] == [9, 0, 11]
    assert manifest["num_samples"] == 20
    shard = data.read_shard(data_dir / "shard_00002.npz")
    feats = np.load(feature_dir / "features_00002.npy")
    assert feats.shape == (shard["offsets"][-1], 3 * 32) and feats.dtype == np.float32
    # Sample 4 of the shard alone, through the target: the cached rows are its features.
    lo, hi = shard["offsets"][4:6]
    ids = jnp.asarray(shard["tokens"][lo:hi][None])
    out = target.model(ids, jnp.arange(hi - lo)[None], tap_layer_ids=TAPS)
    np.testing.assert_allclose(feats[lo:hi], np.concatenate([out.taps, out.hidden], -1)[0],
                               rtol=1e-5, atol=1e-5)


def test_packed_batches_carry_the_online_features(models, cache):
    """Same batches with and without the cache; the packed features are those the target
    computes on the packed rows (segment ids), zero on padding."""
    target, _ = models
    data_dir, feature_dir = cache
    online = batches(data_dir)
    cached = batches(data_dir, feature_dir, key=features.cache_key(target, TAPS))
    for plain, batch in zip(online, cached):
        assert set(batch) == set(pipeline.BATCH_KEYS + pipeline.FEATURE_KEYS)
        for key in pipeline.BATCH_KEYS:
            np.testing.assert_array_equal(batch[key], plain[key])
        taps, hidden = train_step.target_features(target.model, jax.tree.map(jnp.asarray, plain), TAPS)
        real = plain["segment_ids"][..., None] > 0
        np.testing.assert_allclose(batch["taps"], np.where(real, taps, 0), rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(batch["hidden"], np.where(real, hidden, 0), rtol=1e-5, atol=1e-5)
        assert not batch["taps"][~real[..., 0]].any()


@pytest.mark.slow  # online and cached gradients, two programs
def test_loss_and_gradients_equal_online(models, cache):
    target, drafter = models
    data_dir, feature_dir = cache
    grad = jax.jit(jax.value_and_grad(lambda p, b: train_step.loss_fn(
        p, drafter.graphdef, target.graphdef, target.state, b, CFG)[0]))
    for plain, batch in zip(batches(data_dir), batches(data_dir, feature_dir)):
        loss, grads = grad(drafter.state, plain)
        cached_loss, cached_grads = grad(drafter.state, batch)
        assert np.isfinite(float(loss)) and float(loss) > 0
        np.testing.assert_allclose(cached_loss, loss, rtol=1e-5)
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5),
                     cached_grads, grads)


@pytest.mark.slow  # train steps on cached features; CI runs -m slow
def test_train_step_with_cache_equals_online(models, cache):
    target, drafter = models
    data_dir, feature_dir = cache
    # Adam with a large eps: a plain first Adam step is lr * sign(g), which turns rounding-level
    # differences of near-zero gradients into lr-sized parameter differences.
    optimizer = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(3e-3, eps=1e-3))
    mesh = sharding.make_mesh((1, 1, 1), devices=jax.devices()[:1])
    example = jax.eval_shape(lambda s: train_step.init_train_state(s, optimizer), drafter.state)
    step = train_step.make_train_step(drafter.graphdef, target.graphdef, CFG, optimizer, mesh=mesh,
                                      state=example, target_state=target.state)
    results = []
    for feature_dir_or_none in (None, feature_dir):
        state = train_step.init_train_state(drafter.state, optimizer, mesh)
        for batch in batches(data_dir, feature_dir_or_none):
            state, metrics = step(state, target.state, batch)
        results.append((state, metrics))
    (online, online_metrics), (cached, cached_metrics) = results
    for key in online_metrics:
        np.testing.assert_allclose(cached_metrics[key], online_metrics[key], rtol=1e-5, atol=1e-6,
                                   err_msg=key)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6),
                 cached.params, online.params)


@pytest.mark.slow  # train steps on cached features; CI runs -m slow
def test_bfloat16_cache_is_half_size_and_close(models, cache, tmp_path):
    target, drafter = models
    data_dir, feature_dir = cache
    features.extract_features(target, data_dir, tmp_path, TAPS, dtype="bfloat16", batch_size=4,
                              length_multiple=16, progress=False)
    full = np.load(feature_dir / "features_00000.npy")
    half = features.FeatureCache(tmp_path, data_dir).shard(
        0, data.read_shard(data_dir / "shard_00000.npz"))
    assert half.dtype == jnp.bfloat16
    assert (tmp_path / "features_00000.npy").stat().st_size < 0.55 * full.nbytes
    np.testing.assert_allclose(half.astype(np.float32), full, rtol=1e-2, atol=1e-2)
    batch = batches(data_dir, tmp_path, count=1)[0]
    assert batch["taps"].dtype == jnp.bfloat16
    loss = lambda b: float(train_step.loss_fn(drafter.state, drafter.graphdef, target.graphdef,
                                              target.state, b, CFG)[0])
    np.testing.assert_allclose(loss(batch), loss(batches(data_dir, count=1)[0]), rtol=2e-2)


def test_extraction_extends_and_resumes_after_a_kill(models, cache, tmp_path, monkeypatch):
    """A cache of a data folder that grew since gets the new shards only; a run killed inside a
    shard continues with that shard. The files equal those of one uninterrupted run."""
    target, _ = models
    feature_dir = cache[1]
    write = features._write_features
    written = []

    class KillingBar:
        def update(self, n):
            raise KeyboardInterrupt  # killed after the shard's first batch

    def counted(path, *args, kill=False, **kwargs):
        written.append(path.name)
        return write(path, *args, **(dict(kwargs, bar=KillingBar()) if kill else kwargs))

    run = lambda folder: features.extract_features(
        target, folder, tmp_path / "cache", TAPS, batch_size=4, length_multiple=16, progress=False)
    monkeypatch.setattr(features, "_write_features", counted)
    run(write_data(tmp_path / "data", shards=SHARDS[:2]))
    assert written == ["features_00000.npy", "features_00001.npy"]

    shutil.rmtree(tmp_path / "data")
    write_data(tmp_path / "data")  # the data folder grew by a shard
    monkeypatch.setattr(features, "_write_features", lambda *a, **k: counted(*a, kill=True, **k))
    with pytest.raises(KeyboardInterrupt):
        run(tmp_path / "data")
    assert [f["file"] for f in data.load_manifest(tmp_path / "cache")["files"]] == \
        ["features_00000.npy", "features_00001.npy"]
    assert (tmp_path / "cache" / ".features_00002.npy.tmp").exists()

    monkeypatch.setattr(features, "_write_features", counted)
    run(tmp_path / "data")
    assert written[2:] == ["features_00002.npy"] * 2
    manifest = data.load_manifest(tmp_path / "cache")
    reference = data.load_manifest(feature_dir)
    assert manifest["files"] == reference["files"] and manifest["num_tokens"] == reference["num_tokens"]
    for entry in manifest["files"]:
        np.testing.assert_array_equal(np.load(tmp_path / "cache" / entry["file"]),
                                      np.load(feature_dir / entry["file"]))


def test_mismatches_are_named(models, cache, tmp_path):
    target, _ = models
    data_dir, feature_dir = cache
    key = features.cache_key(target, TAPS)
    with pytest.raises(ValueError, match=r"tap_layer_ids=\[0, 2\].*tap_layer_ids=\[1, 2\]"):
        pipeline.ShardSource(data_dir, feature_dir, features.cache_key(target, (1, 2)))
    with pytest.raises(ValueError, match="vocab_size=64.*vocab_size=128"):
        other = init_target(dict(TINY, vocab_size=128), seed=1)
        pipeline.ShardSource(data_dir, feature_dir, features.cache_key(other, TAPS))
    with pytest.raises(ValueError, match="1 feature cache.* for 2 data folder"):
        pipeline.ShardSource([data_dir, data_dir], [feature_dir], key)
    with pytest.raises(ValueError, match="tap_layer_ids"):  # resuming with other taps
        features.extract_features(target, data_dir, feature_dir, (1, 2), progress=False)
    with pytest.raises(ValueError, match="holds float32 features, not bfloat16"):
        features.extract_features(target, data_dir, feature_dir, TAPS, dtype="bfloat16",
                                  progress=False)
    with pytest.raises(FileNotFoundError, match="prepare-features"):
        pipeline.ShardSource(data_dir, tmp_path / "nothing")

    other_data = write_data(tmp_path / "other", shards=[(0, 10), (10, 10), (10, 20)])
    with pytest.raises(ValueError, match="holds 9 samples of shard_00000.npz.*10 samples"):
        pipeline.ShardSource(other_data, feature_dir, key)
    grown = write_data(tmp_path / "grown", shards=SHARDS + [(20, 20)])
    with pytest.raises(ValueError, match="covers 3 of the 4 shards.*prepare-features"):
        pipeline.ShardSource(grown, feature_dir, key)
    regenerated = write_data(tmp_path / "regenerated", seed=1)  # same shard sizes, other tokens
    source = pipeline.ShardSource(regenerated, feature_dir, key)
    with pytest.raises(ValueError, match="tokens of shard_00000.npz differ"):
        source[0]
    shutil.copytree(feature_dir, tmp_path / "resumed")
    with pytest.raises(ValueError, match="tokens of shard_00000.npz differ"):
        features.extract_features(target, regenerated, tmp_path / "resumed", TAPS, progress=False)


def test_drafter_width_mismatch_in_step(models, cache):
    target, drafter = models
    data_dir, feature_dir = cache
    batch = batches(data_dir, feature_dir, count=1)[0]
    batch["taps"] = batch["taps"][..., :32]
    with pytest.raises(ValueError, match="do not fit 2 taps"):
        train_step.loss_fn(drafter.state, drafter.graphdef, target.graphdef, target.state, batch, CFG)


@pytest.mark.slow  # train steps on cached features; CI runs -m slow
def test_cli_and_trainer_with_cache(tmp_path):
    """`dspark-jax prepare-features` then train(): the metrics equal an online run's."""
    target = init_target(TINY, seed=1)
    target.save_hf(tmp_path / "target")
    data_dir = write_data(tmp_path / "data")
    config = tmp_path / "tiny.py"
    config.write_text(textwrap.dedent(f'''
        from dspark_jax import experiment

        def get_config():
            return experiment.experiment_config(
                {str(tmp_path / "target")!r},
                drafter=dict(target_layer_ids={TAPS!r}, mask_token_id=63, block_size=4,
                             num_layers=1, markov_rank=8, head="markov"),
                train=dict(experiment.DSPARK_TRAIN, num_anchors=4, data_dir=({str(data_dir)!r},), max_steps=3,
                           global_batch_size=2, pack_length=48, anchors_per_row=8,
                           anchor_chunk=4, learning_rate=3e-3, log_every=1))
    '''))
    assert cli_main(["prepare-features", "--config", str(config), "--data", str(data_dir),
                     "--output", str(tmp_path / "cache"), "--batch-size", "4"]) == 0
    assert data.load_manifest(tmp_path / "cache")["key"]["tap_layer_ids"] == list(TAPS)

    from dspark_jax.experiment import load_config

    cfg = load_config(config)
    train(cfg, tmp_path / "online", progress=False)
    cfg.train.feature_dir = (str(tmp_path / "cache"),)
    train(cfg, tmp_path / "cached", progress=False)
    records = {}
    for name in ("online", "cached"):
        with open(tmp_path / name / "metrics.jsonl") as f:
            records[name] = [json.loads(line) for line in f]
    assert [r["step"] for r in records["cached"]] == [1, 2, 3]
    for online, cached in zip(records["online"], records["cached"]):
        for key in ("loss", "ce_loss", "l1_loss", "tau_probabilistic", "grad_norm"):
            np.testing.assert_allclose(cached[key], online[key], rtol=1e-5, err_msg=key)

    cfg.train.feature_dir = (str(tmp_path / "cache"),)
    cfg.drafter.target_layer_ids = (1, 2)
    with pytest.raises(ValueError, match="tap_layer_ids"):
        train(cfg, tmp_path / "wrong_taps", progress=False)


def test_heldout_metrics_from_the_cache_equal_online(models, cache):
    """``HeldOut`` over cached features: the same epoch and metrics as with the target online."""
    from dspark_jax.training.heldout import HeldOut

    _, drafter = models
    data_dir, feature_dir = cache
    cfg = ConfigDict(dict(CFG, global_batch_size=PIPE["batch_size"], pack_length=PIPE["pack_length"],
                          anchors_per_row=PIPE["anchors_per_row"], anchor_chunk=2))
    online_epoch, cached_epoch = HeldOut(drafter, data_dir, cfg), HeldOut(
        drafter, data_dir, cfg, feature_dir=feature_dir)
    assert "taps" in cached_epoch.batches[0] and "taps" not in online_epoch.batches[0]
    online = online_epoch.metrics(drafter.state, progress=False)
    cached = cached_epoch.metrics(drafter.state, progress=False)
    assert cached["batches"] == online["batches"] >= 2
    assert cached["valid_blocks"] == online["valid_blocks"] > 0
    for key in ("loss", "tau_probabilistic", "accept_rate@0"):
        assert cached[key] == pytest.approx(online[key], rel=1e-5), key
