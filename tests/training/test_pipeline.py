"""Input pipeline: shard source, anchor sampling, packing invariants, determinism, checkpoints,
per-host sharding. Synthetic data: token 0 of record r is ID_BASE + r, so segments map back."""

from __future__ import annotations

import json

import numpy as np
import pytest

from dspark_jax.training import data, pipeline

ID_BASE = 1000
NUM_RECORDS = 40
CFG = dict(batch_size=2, pack_length=48, anchors_per_row=6, anchors_per_sequence=3, block_size=4)


def synthetic_records(seed: int = 0) -> list[tuple[np.ndarray, np.ndarray]]:
    """Records of 3..70 tokens (some longer than a row), prompts of 1..12 tokens; records 3 and
    17 have a single loss token (no anchor candidate), record 9 has all loss tokens past the row."""
    rng = np.random.default_rng(seed)
    records = []
    for r in range(NUM_RECORDS):
        n = int(rng.integers(3, 70))
        ids = rng.integers(0, 100, n).astype(np.int32)
        ids[0] = ID_BASE + r
        mask = (np.arange(n) >= int(rng.integers(1, min(n - 1, 12)))).astype(np.uint8)
        if r in (3, 17):
            mask[:] = 0
            mask[-1] = 1
        if r == 9:
            ids = np.concatenate([ids[:1], rng.integers(0, 100, 60).astype(np.int32)])
            mask = (np.arange(61) >= 50).astype(np.uint8)
        records.append((ids, mask))
    return records


@pytest.fixture(scope="module")
def records():
    return synthetic_records()


@pytest.fixture(scope="module")
def data_dir(records, tmp_path_factory):
    """The records written as three shards with a manifest, like prepare_data's output."""
    out = tmp_path_factory.mktemp("packed")
    files = []
    for s, (lo, hi) in enumerate([(0, 15), (15, 15), (15, NUM_RECORDS)]):
        name = f"shard_{s:05d}.npz"
        data.write_shard(out / name, [(r, *records[r]) for r in range(lo, hi)])
        files.append(dict(file=name, samples=hi - lo))
    data.write_manifest(out, dict(files=files))
    return out


def candidate_records(records, pack_length) -> set[int]:
    return {r for r, (_, mask) in enumerate(records)
            if pipeline.anchor_candidates(mask[:pack_length]).size}


def segments(batch) -> list[tuple[int, int, np.ndarray]]:
    """(row, segment id, row indices) of every packed sequence of a batch, in packing order."""
    out = []
    for row, seg_ids in enumerate(batch["segment_ids"]):
        for seg in range(1, int(seg_ids.max()) + 1):
            out.append((row, seg, np.flatnonzero(seg_ids == seg)))
    return out


def record_stream(it, count: int) -> list[int]:
    """The record ids of the first ``count`` packed sequences of an iterator."""
    ids = []
    while len(ids) < count:
        batch = next(it)
        ids += [int(batch["input_ids"][row, idx[0]]) - ID_BASE for row, _, idx in segments(batch)]
    return ids[:count]


def make(data_dir, **overrides):
    return pipeline.make_pipeline(data_dir, **{**CFG, "seed": 3, **overrides})


def test_source_reads_records(records, data_dir):
    source = pipeline.ShardSource(data_dir)
    assert len(source) == NUM_RECORDS
    for r in (0, 14, 15, 39):
        rec = source[r]
        assert rec["index"] == r and rec["input_ids"].dtype == np.int32
        np.testing.assert_array_equal(rec["input_ids"], records[r][0])
        np.testing.assert_array_equal(rec["loss_mask"], records[r][1])
    with pytest.raises(IndexError):
        source[NUM_RECORDS]


def test_anchor_sequence_cuts_after_last_block():
    ids = np.arange(30, dtype=np.int32)
    mask = (ids >= 10).astype(np.int32)
    for seed in range(20):
        out = pipeline.anchor_sequence(dict(input_ids=ids, loss_mask=mask),
                                       rng=np.random.default_rng(seed), max_length=25,
                                       num_anchors=4, block_size=5)
        anchors = out["anchors"]
        assert len(anchors) == 4 and np.all(np.diff(anchors) > 0)
        assert anchors.min() >= 10 and anchors.max() <= 23
        assert len(out["input_ids"]) == min(int(anchors.max()) + 6, 25)
        np.testing.assert_array_equal(out["input_ids"], ids[:len(out["input_ids"])])
    assert pipeline.anchor_sequence(dict(input_ids=ids, loss_mask=mask),
                                    rng=np.random.default_rng(0), max_length=11, num_anchors=4,
                                    block_size=5) is None


def test_batch_invariants(records, data_dir):
    it = make(data_dir)
    L, N, B = CFG["pack_length"], CFG["anchors_per_row"], CFG["block_size"]
    packed_rows = full_rows = 0
    for _ in range(12):
        batch = next(it)
        assert {k: (v.shape, v.dtype) for k, v in batch.items()} == dict(
            input_ids=((2, L), np.int32), positions=((2, L), np.int32),
            segment_ids=((2, L), np.int32), loss_mask=((2, L), np.int32),
            anchors=((2, N), np.int32), keep=((2, N), np.bool_))
        pad = batch["segment_ids"] == 0
        assert not (batch["loss_mask"][pad].any() or batch["positions"][pad].any()
                    or batch["input_ids"][pad].any())
        packed_rows += int((batch["segment_ids"].max(axis=1) > 1).sum())
        for row, seg, idx in segments(batch):
            assert np.all(np.diff(idx) == 1), "segments are contiguous"
            np.testing.assert_array_equal(batch["positions"][row, idx], np.arange(len(idx)))
            ids, mask = records[int(batch["input_ids"][row, idx[0]]) - ID_BASE]
            np.testing.assert_array_equal(batch["input_ids"][row, idx], ids[:len(idx)])
            np.testing.assert_array_equal(batch["loss_mask"][row, idx], mask[:len(idx)])
            anchors = batch["anchors"][row][batch["keep"][row]]
            local = anchors[(anchors >= idx[0]) & (anchors <= idx[-1])] - idx[0]
            assert 1 <= len(local) <= CFG["anchors_per_sequence"]
            assert len(idx) == min(int(local.max()) + B + 1, len(ids), L), "context of the blocks"
            full_rows += len(idx) == L
        for row in range(2):
            keep, anchors = batch["keep"][row], batch["anchors"][row]
            assert not np.any(np.diff(keep.astype(int)) > 0), "kept slots are a prefix"
            assert np.all(anchors[~keep] == 0) and np.all(np.diff(anchors[keep]) > 0)
            seg, mask = batch["segment_ids"][row], batch["loss_mask"][row]
            a = anchors[keep]
            assert np.all(mask[a] & mask[a + 1]) and np.all(seg[a] == seg[a + 1]) and seg[a].all()
    assert packed_rows and full_rows, "the data exercise multi-sequence rows and truncation"


def test_anchors_resampled_each_epoch(data_dir):
    dataset, per_epoch = pipeline.anchored_dataset(
        pipeline.ShardSource(data_dir), seed=3, shard_index=0, shard_count=1, max_length=48,
        num_anchors=3, block_size=4)
    by_epoch = [{}, {}]
    for position in range(2 * per_epoch):
        seq = dataset[position]
        if seq is not None:
            by_epoch[position // per_epoch][int(seq["input_ids"][0]) - ID_BASE] = seq["anchors"]
    assert by_epoch[0].keys() == by_epoch[1].keys()
    assert any(not np.array_equal(by_epoch[0][r], by_epoch[1][r]) for r in by_epoch[0])


def test_epoch_keeps_every_candidate_bearing_sequence(records, data_dir):
    expected = candidate_records(records, CFG["pack_length"])
    assert {3, 9, 17}.isdisjoint(expected) and len(expected) == NUM_RECORDS - 3
    it = make(data_dir)
    stream = record_stream(it, 2 * len(expected))
    assert sorted(stream[:len(expected)]) == sorted(expected)
    assert sorted(stream[len(expected):]) == sorted(expected)
    assert stream[:len(expected)] != stream[len(expected):], "each epoch is reshuffled"
    assert it.epoch >= 1


def test_deterministic(data_dir):
    a, b, c = make(data_dir), make(data_dir), make(data_dir, seed=4)
    first = [next(a) for _ in range(5)]
    for batch in first:
        other = next(b)
        for key in pipeline.BATCH_KEYS:
            np.testing.assert_array_equal(batch[key], other[key])
    assert any(not np.array_equal(x["input_ids"], next(c)["input_ids"]) for x in first)


@pytest.mark.parametrize("skip", [3, 14])
def test_checkpoint_restores_the_same_batches(data_dir, skip):
    it = make(data_dir)
    for _ in range(skip):
        next(it)
    state = json.loads(json.dumps(it.get_state()))
    expected = [next(it) for _ in range(6)]
    restored = make(data_dir)
    restored.set_state(state)
    for batch in expected:
        got = next(restored)
        for key in pipeline.BATCH_KEYS:
            np.testing.assert_array_equal(got[key], batch[key], err_msg=key)


def test_host_shards_partition_the_data(records, data_dir):
    expected = candidate_records(records, CFG["pack_length"])
    per_host = []
    for index in range(2):
        host_records = set(range(index, NUM_RECORDS, 2)) & expected
        stream = record_stream(make(data_dir, shard_index=index, shard_count=2), len(host_records))
        assert sorted(stream) == sorted(host_records)
        per_host.append(set(stream))
    assert per_host[0].isdisjoint(per_host[1]) and per_host[0] | per_host[1] == expected
    with pytest.raises(ValueError):
        make(data_dir, shard_index=2, shard_count=2)


@pytest.mark.parametrize("shard_index, shard_count", [(0, 1), (0, 2), (1, 2)])
def test_batches_per_epoch_counts_the_batches_of_one_pass(records, data_dir, shard_index,
                                                          shard_count):
    """The batches holding a sequence of epoch 0 (records 3, 9 and 17 are skipped), per host."""
    host = dict(shard_index=shard_index, shard_count=shard_count)
    first_epoch = len(set(range(shard_index, NUM_RECORDS, shard_count))
                      & candidate_records(records, CFG["pack_length"]))
    it, placed, batches = make(data_dir, **host), 0, 0
    while placed < first_epoch:
        placed += len(segments(next(it)))
        batches += 1
    count = pipeline.batches_per_epoch(data_dir, **{**CFG, "seed": 3, **host})
    assert count == batches
    samples = len(range(shard_index, NUM_RECORDS, shard_count))
    assert count < -(-samples // CFG["batch_size"]), "rows pack several sequences"
    skipped, iterated = make(data_dir, **host), make(data_dir, **host)
    assert skipped.skip_epoch() == count and skipped.epoch == 1
    for _ in range(count):
        next(iterated)
    expected, got = next(iterated), next(skipped)  # skipping leaves the stream as iterating does
    for key in pipeline.BATCH_KEYS:
        np.testing.assert_array_equal(got[key], expected[key], err_msg=key)
