"""Optional on-disk cache of the frozen target's features, to train without the target forward.

Training normally runs the target inside every step (``step.target_features``: the tapped
layers and the last hidden state of packed rows). ``extract_features`` runs it once over every
sample of a prepared data folder (``training/data.py``) instead; the train step then reads the
features from the batches (``pipeline.make_pipeline(feature_dir=...)``) and only uses the
target's embedding and LM head.

Each sample runs alone in a right-padded row (positions from 0, segment id 1, padding 0), which
is how it runs as a segment of a packed training row; it is attended as an inference prefill
is (on an x86 CPU by ``cpu_attention``'s row kernel, where a packed training row takes the
einsum: the same features to float32 rounding). The target is causal, so the
features of a sample truncated to any length are a prefix of the cached ones.

Output folder, for data shard i (``shard_0000i.npz`` of T tokens) of the data folder:

  features_0000i.npy  [T, (m + 1) * d] in ``dtype``, row t = token t of the shard (same order
      and offsets as the shard's ``tokens``): columns [0, m*d) the raw outputs of the tapped
      layers in tap order (``taps``), columns [m*d, (m+1)*d) the final-normed last hidden
      state (``hidden``). Read memory-mapped. bfloat16 files are written with numpy's
      ``|V2`` descriptor and viewed as bfloat16 on reading.
  manifest.json  format, key (target name, vocab_size, hidden_size, num_hidden_layers,
      tap_layer_ids), dtype, data (the data folder), files (file, data_file, samples, tokens,
      tokens_crc32) in data-shard order, num_samples, num_tokens.

Runs are resumable: every file is written to a temporary name and renamed, then the manifest is
rewritten atomically, so a killed run continues after its last complete shard, and a run on a
data folder that has grown since extends the cache.
"""

from __future__ import annotations

import os
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tqdm.auto import tqdm

from dspark_jax import storage
from dspark_jax.drafter_config import FIELDS, check_fit, default_drafter_config
from dspark_jax.models.fused_attention import default_prefill_implementation
from dspark_jax.target import Target
from dspark_jax.training.data import load_manifest, read_shard, tokens_crc32, write_manifest
from dspark_jax.training.step import target_features

FORMAT = "dspark-jax-features-v1"
DTYPES = ("float32", "bfloat16", "float16")


def cache_key(target: Target, tap_layer_ids) -> dict:
    """What cached features depend on: the target (name and shape) and the tapped layers."""
    c = target.config
    return dict(target=target.name, vocab_size=int(c.vocab_size), hidden_size=int(c.hidden_size),
                num_hidden_layers=int(c.num_hidden_layers),
                tap_layer_ids=[int(i) for i in tap_layer_ids])


def config_tap_layer_ids(config, target: Target) -> tuple[int, ...]:
    """The tap layer ids of an experiment config's drafter on ``target`` (its
    ``drafter.target_layer_ids``, else the target's default, as ``init_drafter`` resolves them)."""
    fields = {k: v for k, v in config.drafter.to_dict().items() if k in FIELDS}
    cfg = default_drafter_config(target.config, target.tokenizer, **fields)
    check_fit(cfg, target.config)
    return tuple(cfg.target_layer_ids)


def check_key(manifest: dict, key: dict, where: str) -> None:
    """Raises a ValueError naming the first field where a cache's key differs from ``key``."""
    for field, want in key.items():
        have = manifest["key"].get(field)
        if have != want:
            raise ValueError(f"feature cache {where} was extracted with {field}={have!r}, but "
                             f"this run needs {field}={want!r}: extract a new cache "
                             f"(`dspark-jax prepare-features`) into another folder")


def check_files(manifest: dict, data_manifest: dict, where: str, data_dir, *,
                complete: bool) -> None:
    """Checks that the cache's files are those of the data folder's first shards (all of them
    when ``complete``), by data file name and sample count; raises a ValueError naming the
    first difference."""
    data_files, files = data_manifest["files"], manifest["files"]
    if len(files) > len(data_files):
        raise ValueError(f"feature cache {where} has {len(files)} shards but data folder "
                         f"{data_dir} only {len(data_files)}: it was made from other data")
    for entry, data_entry in zip(files, data_files):
        if (entry["data_file"], entry["samples"]) != (data_entry["file"], data_entry["samples"]):
            raise ValueError(
                f"feature cache {where} does not match data folder {data_dir}: its {entry['file']} "
                f"holds {entry['samples']} samples of {entry['data_file']}, the data folder has "
                f"{data_entry['samples']} samples in {data_entry['file']}")
    if complete and len(files) < len(data_files):
        raise ValueError(f"feature cache {where} covers {len(files)} of the {len(data_files)} shards "
                         f"of data folder {data_dir}: run `dspark-jax prepare-features` again to "
                         f"extend it")


def check_tokens(entry: dict, data_shard: dict[str, np.ndarray], where: str) -> None:
    """Raises a ValueError when a data shard is not the one a cache file was extracted from."""
    if tokens_crc32(data_shard) != entry["tokens_crc32"]:
        raise ValueError(f"feature cache {where}: the tokens of {entry['data_file']} differ from "
                         f"those its features were extracted from (data regenerated?)")


def _data_manifest(data_dir) -> dict:
    manifest = load_manifest(data_dir)
    if manifest is None:
        raise FileNotFoundError(f"no manifest.json in {data_dir}: run `dspark-jax prepare-data` first")
    return manifest


class FeatureCache:
    """Memory-mapped reader of a feature folder written for ``data_dir``.

    Checks on opening that the cache matches the data folder (every shard, by file name and
    sample count) and, when given, ``key`` (:func:`cache_key` of the run's target and taps);
    :meth:`shard` checks the token checksum of the data shard it is read with.
    """

    def __init__(self, feature_dir: str | os.PathLike, data_dir: str | os.PathLike,
                 key: dict | None = None):
        self.dir = storage.as_path(feature_dir)
        manifest = load_manifest(self.dir)
        if manifest is None:
            raise FileNotFoundError(f"no manifest.json in {self.dir}: run `dspark-jax "
                                    "prepare-features` first")
        if manifest.get("format") != FORMAT:
            raise ValueError(f"{self.dir} is not a feature cache (format {manifest.get('format')!r})")
        if key is not None:
            check_key(manifest, key, str(self.dir))
        check_files(manifest, _data_manifest(data_dir), str(self.dir), data_dir, complete=True)
        self.manifest = manifest
        self.dtype = jnp.dtype(manifest["dtype"])
        self.tap_width = len(manifest["key"]["tap_layer_ids"]) * manifest["key"]["hidden_size"]

    def shard(self, index: int, data_shard: dict[str, np.ndarray]) -> np.ndarray:
        """Features [T, (m + 1) * d] (memory-mapped) of data shard ``index`` (its arrays)."""
        entry = self.manifest["files"][index]
        check_tokens(entry, data_shard, str(self.dir))
        return np.load(storage.local_copy(self.dir / entry["file"]), mmap_mode="r").view(self.dtype)


def _feature_fn(target: Target, tap_layer_ids: tuple[int, ...], dtype):
    """Jitted (state, input_ids int32 [b, L], segment_ids int32 [b, L]) -> features
    [b, L, (m + 1) * d] in ``dtype`` (``step.target_features`` of one sample per row, attended
    as an inference prefill: ``fused_attention.default_prefill_implementation``, no gradient)."""
    attention = default_prefill_implementation()

    def features(state, input_ids, segment_ids):
        model = nnx.merge(target.graphdef, state)
        positions = jnp.broadcast_to(jnp.arange(input_ids.shape[1]), input_ids.shape)
        taps, hidden = target_features(model, dict(input_ids=input_ids, positions=positions,
                                                   segment_ids=segment_ids), tap_layer_ids,
                                       attention=attention, max_segments=1)
        return jnp.concatenate([taps, hidden], axis=-1).astype(dtype)

    return jax.jit(features)


def _write_features(path: storage.Path, shard: dict[str, np.ndarray], forward, state, *, width: int,
                    dtype, batch_size: int, length_multiple: int, bar) -> None:
    """Features of every sample of a data shard -> ``path`` (written whole: a staged local file,
    then renamed or uploaded).

    Samples run longest first, ``batch_size`` per call, padded to a multiple of
    ``length_multiple`` tokens (few distinct shapes to compile).
    """
    offsets = shard["offsets"]
    lengths = np.diff(offsets)
    tmp = storage.staging_file(path)
    out = np.lib.format.open_memmap(tmp, mode="w+", dtype=dtype, shape=(int(offsets[-1]), width))
    order = np.argsort(-lengths, kind="stable")
    for start in range(0, len(order), batch_size):
        rows = order[start:start + batch_size]
        length = -(-int(lengths[rows].max()) // length_multiple) * length_multiple
        ids = np.zeros((batch_size, length), np.int32)
        segment_ids = np.zeros((batch_size, length), np.int32)
        for r, i in enumerate(rows):
            ids[r, :lengths[i]] = shard["tokens"][offsets[i]:offsets[i + 1]]
            segment_ids[r, :lengths[i]] = 1
        features = np.asarray(forward(state, ids, segment_ids))
        for r, i in enumerate(rows):
            out[offsets[i]:offsets[i + 1]] = features[r, :lengths[i]]
        bar.update(len(rows))
    out.flush()
    del out
    storage.publish(tmp, path)


def _resume_manifest(out: storage.Path, key: dict, dtype: str, data_dir: storage.Path) -> dict:
    """The existing manifest when it has the same key and dtype; a fresh one when absent."""
    manifest = load_manifest(out)
    if manifest is None:
        return dict(format=FORMAT, key=key, dtype=dtype, data=str(data_dir), files=[],
                    num_samples=0, num_tokens=0)
    if manifest.get("format") != FORMAT:
        raise ValueError(f"{out} holds something else than a feature cache; use a new folder")
    check_key(manifest, key, str(out))
    if manifest["dtype"] != dtype:
        raise ValueError(f"feature cache {out} holds {manifest['dtype']} features, not {dtype}: "
                         f"use another folder")
    return manifest


def extract_features(target: Target, data_dir: str | os.PathLike, output_dir: str | os.PathLike,
                     tap_layer_ids, *, dtype: str = "float32", batch_size: int = 8,
                     length_multiple: int = 128, progress: bool = True) -> dict:
    """Runs the target once over every sample of a data folder and writes a feature cache.

    Args:
      target: the frozen target, in the dtype training computes in (float32 on CPU, bfloat16
        on accelerators: ``trainer.compute_dtype()``) so that cached and online features agree.
      data_dir: a folder written by ``prepare_data``.
      output_dir: the cache folder (created; a run there with the same target, taps and dtype
        is resumed after its last complete shard, or extended when the data folder grew).
      tap_layer_ids: the drafter's ``target_layer_ids``.
      dtype: storage dtype, "float32" (the default: training with the cache is numerically the
        online training), "bfloat16" or "float16" (half the disk, rounded features).
      batch_size: samples per target call.
      length_multiple: samples are padded to a multiple of this many tokens.
      progress: show a tqdm bar (samples, with tokens/s).

    Returns:
      The manifest (also in ``output_dir/manifest.json``).
    """
    if dtype not in DTYPES:
        raise ValueError(f"feature dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    if min(batch_size, length_multiple) < 1:
        raise ValueError("batch_size and length_multiple must be >= 1")
    data_dir = storage.as_path(data_dir)
    data_manifest = _data_manifest(data_dir)
    out = storage.as_path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    tap_layer_ids = tuple(int(i) for i in tap_layer_ids)
    manifest = _resume_manifest(out, cache_key(target, tap_layer_ids), dtype, data_dir)
    check_files(manifest, data_manifest, str(out), data_dir, complete=False)
    for entry in manifest["files"]:
        check_tokens(entry, read_shard(data_dir / entry["data_file"]), str(out))
    stored = jnp.dtype(dtype)
    forward = _feature_fn(target, tap_layer_ids, stored)
    width = (len(tap_layer_ids) + 1) * int(target.config.hidden_size)
    todo = data_manifest["files"][len(manifest["files"]):]
    bar = tqdm(total=sum(f["samples"] for f in data_manifest["files"]),
               initial=manifest["num_samples"], unit="sample", desc="prepare_features",
               disable=not progress, dynamic_ncols=True)
    tokens, started = 0, time.perf_counter()
    for index, data_entry in enumerate(todo, len(manifest["files"])):
        shard = read_shard(data_dir / data_entry["file"])
        target.check_token_ids(shard["tokens"])
        name = f"features_{index:05d}.npy"
        _write_features(out / name, shard, forward, target.state, width=width, dtype=stored,
                        batch_size=batch_size, length_multiple=length_multiple, bar=bar)
        samples, shard_tokens = len(shard["offsets"]) - 1, int(shard["offsets"][-1])
        manifest["files"].append(dict(file=name, data_file=data_entry["file"], samples=samples,
                                      tokens=shard_tokens, tokens_crc32=tokens_crc32(shard)))
        manifest["num_samples"] += samples
        manifest["num_tokens"] += shard_tokens
        write_manifest(out, manifest)
        tokens += shard_tokens
        bar.set_postfix(tokens_per_s=f"{tokens / (time.perf_counter() - started):.0f}")
    bar.close()
    write_manifest(out, manifest)
    return manifest
