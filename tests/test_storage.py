"""Object-store paths (gs://) through the same code as local ones: storage's primitives, data
folders, feature caches, target and drafter folders, training logs, served from a fake GCS
(tests/fake_gcs.py: whole-object writes only, no appends, no memory maps)."""

from __future__ import annotations

import json
import os

import jax
import numpy as np
import pytest

import dspark_jax
from dspark_jax import storage
from dspark_jax.target import init_target
from dspark_jax.training import data, features, pipeline, trainer

TINY = dict(architectures=["Qwen3ForCausalLM"], vocab_size=64, hidden_size=32, intermediate_size=64,
            num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
            eos_token_id=3)
TAPS = (0, 2)
PIPE = dict(batch_size=2, pack_length=48, anchors_per_row=6, anchors_per_sequence=3, block_size=4,
            seed=5)


def test_paths():
    assert storage.is_remote("gs://bucket/x") and storage.is_remote("s3://b/k")
    assert not storage.is_remote("/data/x") and not storage.is_remote("relative/x")
    assert os.fspath(storage.as_path("gs://bucket/a/b")) == "gs://bucket/a/b"
    assert os.fspath(storage.as_path("rel")) == os.path.abspath("rel")


@pytest.mark.parametrize("where", ["local", "gs"])
def test_whole_writes_and_line_logs(where, tmp_path, fake_gcs):
    root = storage.as_path(tmp_path / "run" if where == "local" else "gs://bucket/run")
    root.mkdir(parents=True, exist_ok=True)
    storage.write_atomic(root / "config.json", '{"a": 1}')
    storage.write_atomic(root / "config.json", b'{"a": 2}')
    assert json.loads((root / "config.json").read_text()) == {"a": 2}
    (root / "metrics.jsonl").write_text("zero\n")  # a resumed run's log
    log = storage.LineLog(root / "metrics.jsonl", flush_s=3600)
    log.write("one\n")
    # locally the line is there at once; an object (which cannot be appended to) is rewritten
    # on flush, not on every line
    assert (root / "metrics.jsonl").read_text() == ("zero\none\n" if where == "local" else "zero\n")
    log.write("two\n")
    log.flush()
    assert (root / "metrics.jsonl").read_text() == "zero\none\ntwo\n"
    assert sorted(p.name for p in root.iterdir()) == ["config.json", "metrics.jsonl"]  # no temporaries


def test_local_copy_is_fetched_once_and_again_when_the_object_changes(fake_gcs):
    path = storage.as_path("gs://bucket/f.bin")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"abc")
    local = storage.local_copy(path)
    assert local.read_bytes() == b"abc" and str(local).startswith(os.environ["DSPARK_JAX_CACHE"])
    local.write_bytes(b"zzz")  # a cached copy of the same version is not fetched again
    assert storage.local_copy(path).read_bytes() == b"zzz"
    path.write_bytes(b"xyz")  # rewritten, same size: another version (generation), fetched
    assert storage.local_copy(path).read_bytes() == b"xyz"


def test_a_folder_is_uploaded_with_its_marker_last_and_replaces_the_old_one(fake_gcs):
    def write(version):
        def files(tmp):
            (tmp / "config.json").write_text(json.dumps({"version": version}))
            (tmp / "sub").mkdir()
            (tmp / "sub" / "x.bin").write_bytes(b"x" * version)
            if version == 1:
                (tmp / "stale.bin").write_bytes(b"old")
        return files

    folder = storage.as_path("gs://bucket/drafter")
    storage.write_folder(folder, write(1))
    assert (storage.local_folder(folder) / "stale.bin").exists()
    fake_gcs.writes.clear()
    storage.write_folder(folder, write(2))
    assert fake_gcs.writes == ["bucket/drafter/sub/x.bin", "bucket/drafter/config.json"]
    assert sorted(p.name for p in folder.iterdir()) == ["config.json", "sub"]
    local = storage.local_folder(folder)  # the mirror drops what the folder no longer has
    mirrored = sorted(p.name for p in local.iterdir() if not p.name.startswith("."))
    assert mirrored == ["config.json", "sub"]
    assert json.loads((local / "config.json").read_text()) == {"version": 2}
    assert (local / "sub" / "x.bin").read_bytes() == b"xx"


def test_an_interrupted_folder_upload_leaves_no_marker(fake_gcs, monkeypatch):
    def files(tmp):
        (tmp / "config.json").write_text("{}")
        (tmp / "model.safetensors").write_bytes(b"w")

    folder = storage.as_path("gs://bucket/target")
    storage.write_folder(folder, files)
    real = storage._upload

    def fail_on_weights(local, path):
        if path.name == "model.safetensors":
            raise OSError("preempted")
        real(local, path)

    monkeypatch.setattr(storage, "_upload", fail_on_weights)
    with pytest.raises(OSError, match="preempted"):
        storage.write_folder(folder, files)
    assert not (folder / "config.json").exists()  # no reader takes the folder for complete


def _write_data(folder, num_samples=14):
    rng = np.random.default_rng(0)
    samples = []
    for i in range(num_samples):
        n = int(rng.integers(6, 41))
        mask = (np.arange(n) >= int(rng.integers(2, 6))).astype(np.uint8)
        samples.append((i, rng.integers(4, 64, n).astype(np.int32), mask))
    folder = storage.as_path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    files = []
    for s, (lo, hi) in enumerate([(0, 6), (6, num_samples)]):
        data.write_shard(folder / f"shard_{s:05d}.npz", samples[lo:hi])
        files.append(dict(file=f"shard_{s:05d}.npz", samples=hi - lo))
    data.write_manifest(folder, dict(files=files, num_samples=num_samples))
    return folder


def test_data_folders_and_feature_caches_on_the_object_store(tmp_path, fake_gcs, monkeypatch):
    """The same samples and features, local and on gs://: equal shards, caches and batches;
    the remote cache is written whole (no temporaries) and read through local copies."""
    target = init_target(TINY, seed=1)
    folders = {}
    for where, root in (("local", tmp_path / "local"), ("gs", "gs://bucket/campaign")):
        data_dir = _write_data(f"{root}/data")
        cache_dir = f"{root}/features"
        features.extract_features(target, data_dir, cache_dir, TAPS, batch_size=4,
                                  length_multiple=16, progress=False)
        folders[where] = data_dir, cache_dir
    remote = storage.as_path(folders["gs"][1])
    assert sorted(p.name for p in remote.iterdir()) == [
        "features_00000.npy", "features_00001.npy", "manifest.json"]
    # read the objects themselves, not the copies this process kept when it uploaded them
    monkeypatch.setenv("DSPARK_JAX_CACHE", str(tmp_path / "fresh_cache"))
    for name in ("shard_00000.npz", "shard_00001.npz"):
        local, there = (data.read_shard(storage.as_path(folders[w][0]) / name) for w in folders)
        assert all(np.array_equal(local[k], there[k]) for k in local)
    key = features.cache_key(target, TAPS)
    runs = {w: pipeline.make_pipeline(d, feature_dir=c, feature_key=key, **PIPE)
            for w, (d, c) in folders.items()}
    for _ in range(3):
        local, there = next(runs["local"]), next(runs["gs"])
        assert local.keys() == there.keys()
        for k in local:
            np.testing.assert_array_equal(local[k], there[k])


def test_target_and_drafter_folders_on_the_object_store(fake_gcs, tmp_path, monkeypatch):
    target = init_target(TINY, seed=1)
    remote = target.save_hf("gs://bucket/models/qwen3")
    assert isinstance(remote, storage.Path) and os.fspath(remote) == "gs://bucket/models/qwen3"
    local = target.save_hf(tmp_path / "qwen3")  # what callers expect of a local path
    assert type(local) is type(tmp_path) and local.stat().st_size > 0
    assert fake_gcs.writes[-1] == "bucket/models/qwen3/config.json"  # complete once it is there
    loaded = dspark_jax.load_target("gs://bucket/models/qwen3")
    assert loaded.config == target.config
    for a, b in zip(jax.tree.leaves(target.state), jax.tree.leaves(loaded.state)):
        np.testing.assert_array_equal(a, b)
    drafter = dspark_jax.init_drafter(target, seed=2, num_layers=1, markov_rank=8, block_size=4,
                                      target_layer_ids=TAPS)
    drafter.save("gs://bucket/runs/drafter")
    monkeypatch.setenv("DSPARK_JAX_CACHE", str(tmp_path / "fresh_cache"))
    back = dspark_jax.load_drafter("gs://bucket/runs/drafter", loaded)
    for a, b in zip(jax.tree.leaves(drafter.state), jax.tree.leaves(back.state)):
        np.testing.assert_array_equal(a, b)


def test_training_logs_on_the_object_store(fake_gcs):
    workdir = storage.as_path("gs://bucket/runs/tiny")
    workdir.mkdir(parents=True, exist_ok=True)
    logger = trainer._Logger(workdir)
    for step in (1, 2, 3):
        logger.log(dict(step=step, loss=1.0 / step))
    logger.file.flush()  # as the trainer does at each checkpoint
    lines = (workdir / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [1, 2, 3]


@pytest.mark.slow  # two short training runs; CI runs -m slow
def test_a_run_reads_everything_from_the_object_store(tmp_path, fake_gcs):
    """train() with the target, data, feature cache, held-out split and warm start on gs://
    logs the same metrics and held-out curve as the same run on local paths (the workdir stays
    local: Orbax writes gs:// through tensorstore's own GCS driver)."""
    from dspark_jax import experiment

    target = init_target(TINY, seed=1)
    drafter = dspark_jax.init_drafter(target, seed=2, num_layers=1, markov_rank=8, block_size=4,
                                      target_layer_ids=TAPS, mask_token_id=63)
    runs = {}
    for where, root in (("local", str(tmp_path / "inputs")), ("gs", "gs://bucket/inputs")):
        target.save_hf(f"{root}/target")
        drafter.save(f"{root}/init")
        data_dir = _write_data(f"{root}/data")
        features.extract_features(dspark_jax.load_target(f"{root}/target"), data_dir,
                                  f"{root}/features", TAPS, batch_size=4, length_multiple=16,
                                  progress=False)
        cfg = experiment.experiment_config(
            f"{root}/target",
            drafter=dict(target_layer_ids=TAPS, mask_token_id=63, block_size=4, num_layers=1,
                         markov_rank=8, head="markov"),
            train=dict(experiment.DSPARK_TRAIN, num_anchors=4, max_steps=3, global_batch_size=2,
                       pack_length=48, anchors_per_row=8, anchor_chunk=4, learning_rate=3e-3,
                       log_every=1, init_from=f"{root}/init", data_dir=(str(data_dir),),
                       feature_dir=(f"{root}/features",), heldout_dir=(str(data_dir),),
                       heldout_feature_dir=(f"{root}/features",), heldout_every=3))
        workdir = tmp_path / f"run_{where}"
        trainer.train(cfg, workdir, progress=False)
        runs[where] = [[json.loads(line) for line in open(workdir / name)]
                       for name in ("metrics.jsonl", "heldout.jsonl")]
    for local, there in zip(*runs.values()):
        assert [r["step"] for r in local] == [r["step"] for r in there]
        for a, b in zip(local, there):
            for key in ("loss", "tau_probabilistic"):
                if key in a:
                    np.testing.assert_allclose(b[key], a[key], rtol=1e-6, err_msg=key)
