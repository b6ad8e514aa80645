"""Training input pipeline: grain over the prepared shards, anchor sampling, packing.

Stages (a ``grain.MapDataset`` up to the packer):

1. ``ShardSource``: random access over the shards of ``dspark_jax.training.data``; record i is
   dict(input_ids int32 [S], loss_mask int32 [S], index int = i), plus taps [S, m*d] and
   hidden [S, d] when a feature cache is given (``dspark_jax.training.features``).
2. Per-host slice ``[shard_index::shard_count]``, ``shuffle(seed)`` (a new order each epoch),
   ``repeat()`` (endless stream; stream position p is in epoch p // records_per_host).
3. ``anchor_sequence``: truncate to the row length, sample up to ``anchors_per_sequence``
   anchors uniformly without replacement among the candidates (loss_mask[i] & loss_mask[i+1],
   spec 4.1) with an RNG seeded by (seed, record index, epoch), and cut the sequence after the
   last anchor's block (the context the anchors need, their blocks and the last label; cached
   features are cut alike). Sequences without a candidate are skipped.
4. ``PackedBatches``: greedy in-order packing into rows of ``pack_length`` tokens and
   ``anchors_per_row`` anchor slots; a sequence that does not fit the open row (tokens or
   anchor slots) closes it and opens the next one.

Batches are numpy dicts:
  input_ids   int32 [b, L]  packed rows (0 on padding)
  positions   int32 [b, L]  position within its own sequence (restarts at 0 per segment)
  segment_ids int32 [b, L]  1, 2, ... per packed sequence; 0 = padding
  loss_mask   int32 [b, L]  1 on assistant tokens (0 on padding)
  anchors     int32 [b, N]  sorted row indices of the anchors, then 0 in unused slots
  keep        bool  [b, N]  True on used anchor slots (a prefix of the N slots)
and, with a feature cache, packed exactly like input_ids (0 on padding), in the cache's dtype:
  taps        [b, L, m*d]   the target's tapped layers (``step.target_features``)
  hidden      [b, L, d]     the target's final-normed last hidden states

The packer's state is only the stream position of the next unplaced sequence: a row closes when
a sequence does not fit, and that sequence starts the next row, so every batch is a pure
function of the position where it starts. ``batches_per_epoch`` counts the batches of one pass
over the data by running the packing alone (the trainer's steps per epoch).
"""

from __future__ import annotations

import os
from typing import Sequence

import grain
import numpy as np

from dspark_jax import storage
from dspark_jax.training.data import load_manifest, read_shard
from dspark_jax.training.features import FeatureCache

BATCH_KEYS = ("input_ids", "positions", "segment_ids", "loss_mask", "anchors", "keep")
FEATURE_KEYS = ("taps", "hidden")
TOKEN_KEYS = ("input_ids", "loss_mask") + FEATURE_KEYS  # per-token arrays of a sequence


def _folders(dirs) -> list[storage.Path]:
    return [storage.as_path(d) for d in ([dirs] if isinstance(dirs, (str, os.PathLike)) else dirs)]


class ShardSource:
    """grain RandomAccessDataSource over prepared data folders (shards kept in memory once read).

    Record i: dict(input_ids int32 [S], loss_mask int32 [S], index int), plus taps [S, m*d] and
    hidden [S, d] (memory-mapped, the cache's dtype) when ``feature_dir`` is given: one feature
    cache per data folder, checked against it and against ``feature_key``
    (``features.cache_key``) when given.
    """

    def __init__(self, data_dir: str | os.PathLike | Sequence[str | os.PathLike],
                 feature_dir: str | os.PathLike | Sequence[str | os.PathLike] | None = None,
                 feature_key: dict | None = None):
        self._dirs = _folders(data_dir)
        feature_dirs = None if feature_dir is None else _folders(feature_dir)
        if feature_dirs is not None and len(feature_dirs) != len(self._dirs):
            raise ValueError(f"{len(feature_dirs)} feature cache(s) for {len(self._dirs)} data "
                             "folder(s): give one cache per data folder, in the same order")
        self._files: list[storage.Path] = []
        self._caches: list[tuple[FeatureCache, int] | None] = []  # per shard: (cache, its shard)
        samples = []
        for d, folder in enumerate(self._dirs):
            manifest = load_manifest(folder)
            if manifest is None:
                raise FileNotFoundError(f"no manifest.json in {folder}: run prepare_data first")
            self._files += [folder / f["file"] for f in manifest["files"]]
            samples += [f["samples"] for f in manifest["files"]]
            cache = None if feature_dirs is None else FeatureCache(feature_dirs[d], folder, feature_key)
            self._caches += [None if cache is None else (cache, j)
                             for j in range(len(manifest["files"]))]
        self._starts = np.cumsum([0] + samples)
        self._shards: dict[int, dict[str, np.ndarray]] = {}

    def __len__(self) -> int:
        return int(self._starts[-1])

    def __repr__(self) -> str:
        return f"ShardSource({[str(d) for d in self._dirs]!r})"

    def _shard(self, shard: int) -> dict[str, np.ndarray]:
        if shard not in self._shards:
            arrays = read_shard(self._files[shard])
            if self._caches[shard] is not None:
                cache, index = self._caches[shard]
                features = cache.shard(index, arrays)
                arrays["taps"] = features[:, :cache.tap_width]
                arrays["hidden"] = features[:, cache.tap_width:]
            self._shards[shard] = arrays
        return self._shards[shard]

    def __getitem__(self, index: int) -> dict:
        index = int(index)
        if not 0 <= index < len(self):
            raise IndexError(f"record {index} out of range [0, {len(self)})")
        shard = int(np.searchsorted(self._starts, index, side="right")) - 1
        arrays = self._shard(shard)
        local = index - int(self._starts[shard])
        lo, hi = arrays["offsets"][local], arrays["offsets"][local + 1]
        record = dict(input_ids=arrays["tokens"][lo:hi].astype(np.int32),
                      loss_mask=arrays["loss_mask"][lo:hi].astype(np.int32), index=index)
        record.update({key: arrays[key][lo:hi] for key in FEATURE_KEYS if key in arrays})
        return record


def record_rng(seed: int, index: int, epoch: int) -> np.random.Generator:
    """The anchor-sampling RNG of record ``index`` in ``epoch``."""
    return np.random.default_rng([seed, index, epoch])


def anchor_candidates(loss_mask: np.ndarray) -> np.ndarray:
    """Indices i (int64 [c]) with loss_mask[i] and loss_mask[i + 1] (spec 4.1)."""
    mask = np.asarray(loss_mask).astype(bool)
    return np.flatnonzero(mask[:-1] & mask[1:])


def anchor_sequence(record: dict, *, rng: np.random.Generator, max_length: int, num_anchors: int,
                    block_size: int) -> dict | None:
    """Samples a record's anchors and cuts it to the context they need.

    Returns dict(input_ids int32 [s], loss_mask int32 [s], anchors int32 [k]) with k <=
    num_anchors sorted anchors chosen uniformly without replacement among the candidates of the
    record truncated to ``max_length``, and s = min(max anchor + block_size + 1, truncated
    length): the last slot of a block predicts the token at anchor + block_size. The record's
    taps [s, m*d] and hidden [s, d], when it has them, are cut alike. None when the truncated
    record has no candidate.
    """
    mask = record["loss_mask"][:max_length]
    candidates = anchor_candidates(mask)
    if candidates.size == 0:
        return None
    anchors = np.sort(rng.choice(candidates, size=min(num_anchors, candidates.size),
                                 replace=False))
    end = min(int(anchors[-1]) + block_size + 1, len(mask))
    seq = {key: record[key][:end] for key in TOKEN_KEYS if key in record}
    seq.update(input_ids=np.asarray(seq["input_ids"], np.int32),
               loss_mask=np.asarray(seq["loss_mask"], np.int32), anchors=anchors.astype(np.int32))
    return seq


def anchored_dataset(source, *, seed: int, shard_index: int, shard_count: int, max_length: int,
                     num_anchors: int, block_size: int) -> tuple[grain.MapDataset, int]:
    """(endless MapDataset of ``anchor_sequence`` outputs or None, records per epoch).

    The host's records are ``source[shard_index::shard_count]``, reshuffled every epoch.
    """
    if not 0 <= shard_index < shard_count:
        raise ValueError(f"shard_index {shard_index} not in [0, {shard_count})")
    ds = grain.MapDataset.source(source)[shard_index::shard_count]
    per_epoch = len(ds)
    if per_epoch == 0:
        raise ValueError(f"host shard {shard_index}/{shard_count} of {source!r} has no records")

    def transform(position: int, record: dict) -> dict | None:
        rng = record_rng(seed, record["index"], position // per_epoch)
        return anchor_sequence(record, rng=rng, max_length=max_length, num_anchors=num_anchors,
                               block_size=block_size)

    return ds.shuffle(seed=seed).repeat().map_with_index(transform), per_epoch


def pack_row(sequences: list[dict], pack_length: int, anchors_per_row: int) -> dict:
    """One packed row (arrays [L], [L, ...] and [N], see the module docstring) from
    ``anchor_sequence`` outputs whose lengths and anchor counts fit."""
    row = {key: np.zeros(pack_length, np.int32)
           for key in ("input_ids", "positions", "segment_ids", "loss_mask")}
    token_keys = [key for key in TOKEN_KEYS if key in sequences[0]]
    row.update({key: np.zeros((pack_length,) + sequences[0][key].shape[1:], sequences[0][key].dtype)
                for key in FEATURE_KEYS if key in sequences[0]})
    row.update(anchors=np.zeros(anchors_per_row, np.int32), keep=np.zeros(anchors_per_row, bool))
    start = slot = 0
    for segment, seq in enumerate(sequences, 1):
        length, count = len(seq["input_ids"]), len(seq["anchors"])
        span = slice(start, start + length)
        for key in token_keys:
            row[key][span] = seq[key]
        row["positions"][span] = np.arange(length)
        row["segment_ids"][span] = segment
        row["anchors"][slot:slot + count] = seq["anchors"] + start
        row["keep"][slot:slot + count] = True
        start, slot = start + length, slot + count
    return row


class PackedBatches:
    """Iterator of packed batches (module docstring) over an ``anchored_dataset``.

    Checkpointable: ``get_state()`` is a JSON-serialisable dict; ``set_state(state)`` makes the
    iterator continue with exactly the batches an uninterrupted one would produce.
    """

    def __init__(self, dataset: grain.MapDataset, *, records_per_epoch: int, batch_size: int,
                 pack_length: int, anchors_per_row: int):
        self._dataset = dataset
        self._per_epoch = records_per_epoch
        self._batch_size = batch_size
        self._pack_length = pack_length
        self._anchors_per_row = anchors_per_row
        self._cursor = 0
        self._peeked: tuple[int, dict] | None = None

    def __iter__(self) -> "PackedBatches":
        return self

    @property
    def epoch(self) -> int:
        """Epoch of the next sequence to place (0-based)."""
        return self._cursor // self._per_epoch

    def get_state(self) -> dict:
        return dict(cursor=self._cursor)

    def set_state(self, state: dict) -> None:
        self._cursor = int(state["cursor"])
        self._peeked = None

    def _peek(self) -> dict:
        """The next sequence with anchors; moves the cursor past skipped records."""
        skipped = 0
        while self._peeked is None or self._peeked[0] != self._cursor:
            seq = self._dataset[self._cursor]
            if seq is not None:
                self._peeked = (self._cursor, seq)
            else:
                self._cursor += 1
                skipped += 1
                if skipped > self._per_epoch:
                    raise ValueError("no record of this host has an anchor candidate")
        return self._peeked[1]

    def _row_sequences(self) -> list[dict]:
        """The sequences of the next row (greedy, in order); moves the cursor past them."""
        sequences, length, anchors = [], 0, 0
        while True:
            seq = self._peek()
            if sequences and (length + len(seq["input_ids"]) > self._pack_length
                              or anchors + len(seq["anchors"]) > self._anchors_per_row):
                return sequences
            sequences.append(seq)
            length += len(seq["input_ids"])
            anchors += len(seq["anchors"])
            self._cursor += 1

    def __next__(self) -> dict:
        rows = [pack_row(self._row_sequences(), self._pack_length, self._anchors_per_row)
                for _ in range(self._batch_size)]
        return {key: np.stack([row[key] for row in rows]) for key in rows[0]}

    def skip_epoch(self) -> int:
        """Moves past the rest of the current epoch without building rows; returns the number of
        batches ``next`` would have yielded meanwhile: those holding at least one sequence of the
        epoch (the last one may start the next epoch)."""
        epoch, batches = self.epoch, 0
        while True:
            self._peek()  # past skipped records: the cursor is at the next sequence to place
            if self.epoch != epoch:
                return batches
            for _ in range(self._batch_size):
                self._row_sequences()
            batches += 1


def make_pipeline(data_dir: str | os.PathLike | Sequence[str | os.PathLike], *, batch_size: int, pack_length: int,
                  anchors_per_row: int, anchors_per_sequence: int, block_size: int, seed: int,
                  shard_index: int = 0, shard_count: int = 1,
                  feature_dir: str | os.PathLike | Sequence[str | os.PathLike] | None = None,
                  feature_key: dict | None = None) -> PackedBatches:
    """The packed-batch iterator of a prepared data folder (module docstring).

    Args:
      data_dir: a folder written by ``prepare_data``, or a list of them (concatenated).
      batch_size: rows per batch (per host).
      pack_length: L, tokens per row; longer sequences are truncated to L.
      anchors_per_row: N, anchor slots per row.
      anchors_per_sequence: at most this many anchors per sequence (capped at N).
      block_size: B, drafter block size (anchor + proposals).
      seed: shuffle and anchor-sampling seed, in [0, 2**32).
      shard_index, shard_count: this host's slice of the records.
      feature_dir: feature caches (``features.extract_features``), one per data folder, or
        None (no cached features: the train step runs the target).
      feature_key: ``features.cache_key`` of the run's target and taps, checked against the
        caches (None: not checked).
    """
    if min(batch_size, anchors_per_row, anchors_per_sequence, block_size) < 1 or pack_length < 2:
        raise ValueError("batch_size, anchors and block_size must be >= 1, pack_length >= 2")
    dataset, per_epoch = anchored_dataset(
        ShardSource(data_dir, feature_dir, feature_key), seed=seed, shard_index=shard_index,
        shard_count=shard_count, max_length=pack_length, num_anchors=min(anchors_per_sequence, anchors_per_row),
        block_size=block_size)
    return PackedBatches(dataset, records_per_epoch=per_epoch, batch_size=batch_size,
                         pack_length=pack_length, anchors_per_row=anchors_per_row)


def batches_per_epoch(data_dir: str | os.PathLike | Sequence[str | os.PathLike],
                      **settings) -> int:
    """The number of batches ``make_pipeline(data_dir, **settings)`` yields for one pass over
    this host's records (``PackedBatches.skip_epoch`` from the start).

    The packing runs over the data once without building rows. It depends only on the
    sequences' lengths and anchors, not on cached features: the count holds for the pipeline
    with a ``feature_dir`` too, so leave it out of ``settings`` (the caches are then not read).
    """
    return make_pipeline(data_dir, **settings).skip_epoch()
