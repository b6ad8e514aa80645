"""Hugging Face safetensors folders: a tensor-by-tensor reader, the name map, and the writer.

The name map is one rule for every model in the project (target and drafter): a parameter path
of our NNX state, e.g. ``("layers", "self_attn", "q_proj", "kernel")``, becomes the torch key
``{prefix}layers.{i}.self_attn.q_proj.weight``; ``kernel`` leaves are the transpose of torch's
``[out, in]`` weights, and the stacked ``layers`` axis is split into one tensor per layer.
Overrides cover the few names that do not follow the rule (the target's ``lm_head`` lives
outside the ``model.`` prefix).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Callable, Iterable, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from safetensors import safe_open
from safetensors.numpy import save_file

from dspark_jax.checkpoints.errors import CheckpointError

SAFETENSORS_INDEX = "model.safetensors.index.json"
SAFETENSORS_SINGLE = "model.safetensors"


class TensorSource:
    """Read-only mapping of checkpoint key -> numpy array, read lazily one tensor at a time."""

    def keys(self) -> Iterable[str]:
        raise NotImplementedError

    def get(self, key: str) -> np.ndarray:
        raise NotImplementedError

    def __contains__(self, key: str) -> bool:
        return key in set(self.keys())


class SafetensorsFolder(TensorSource):
    """The safetensors files of a folder: one ``model.safetensors`` or shards with an index."""

    def __init__(self, folder: str | os.PathLike):
        self.folder = Path(folder)
        self._handles: dict[Path, object] = {}
        index = self.folder / SAFETENSORS_INDEX
        if index.exists():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError) as e:
                raise CheckpointError(f"corrupt safetensors index {index}: {e}") from e
            missing = sorted({f for f in weight_map.values() if not (self.folder / f).exists()})
            if missing:
                raise CheckpointError(
                    f"incomplete download in {self.folder}: shard file(s) {', '.join(missing)} "
                    f"named by {SAFETENSORS_INDEX} are missing")
            self._files = {k: self.folder / f for k, f in weight_map.items()}
        else:
            files = sorted(self.folder.glob("*.safetensors"))
            if not files:
                raise CheckpointError(f"no safetensors weights in {self.folder}")
            self._files = {}
            for f in files:
                for key in self._open(f).keys():
                    self._files[key] = f

    def _open(self, path: Path):
        if path not in self._handles:
            try:
                self._handles[path] = safe_open(str(path), framework="numpy")
            except Exception as e:  # safetensors raises its own error types for bad headers
                raise CheckpointError(f"corrupt or partial safetensors file {path}: {e}") from e
        return self._handles[path]

    def keys(self):
        return self._files.keys()

    def __contains__(self, key):
        return key in self._files

    def get(self, key: str) -> np.ndarray:
        try:
            return self._open(self._files[key]).get_tensor(key)
        except KeyError:
            raise
        except Exception as e:
            raise CheckpointError(
                f"corrupt or partial safetensors file {self._files[key]} (tensor {key!r}): {e}") from e


# ----------------------------------------------------------------------------- name map


# Stacked layer collections: "layers", and Gemma4's full-attention layers stacked apart. Both
# are the torch model's "layers.N" (``Decoder.global_layers``, ``model_config.layer_groups``).
STACKS = ("layers", "global_layers")


def torch_key(path: tuple, layer: int | None, prefix: str, overrides: Mapping[tuple, str]) -> str:
    """Torch key of one parameter (of layer id ``layer`` of a stacked one)."""
    if path in overrides:
        return overrides[path]
    parts = [str(p) for p in path]
    if parts[-1] in ("kernel", "embedding"):
        parts[-1] = "weight"
    if parts[0] in STACKS:
        parts[:1] = ["layers", str(layer)]
    return prefix + ".".join(parts)


def layer_id(path: tuple, index: int, layer_ids: Mapping[str, Iterable[int]] | None) -> int:
    """The layer id of entry ``index`` of a stacked parameter: its position in the stack, or
    ``layer_ids[stack]`` (the layer ids of each stack) when given."""
    ids = (layer_ids or {}).get(path[0])
    return index if ids is None else tuple(ids)[index]


def is_transposed(path: tuple, overrides_transposed: Iterable[tuple] = ()) -> bool:
    """Whether our array is the transpose of the torch tensor ([in, out] vs [out, in])."""
    return path[-1] == "kernel" or path in tuple(overrides_transposed)


def _flat_params(state: nnx.State) -> dict[tuple, nnx.Variable]:
    return {tuple(str(p) for p in path): var for path, var in nnx.to_flat_state(state)}


def load_params(abstract_state: nnx.State, source: TensorSource, *, prefix: str,
                overrides: Mapping[tuple, str] = (), transposed: Iterable[tuple] = (),
                dtype=None, transform: Callable[[str, np.ndarray], np.ndarray] | None = None,
                progress=None, layer_ids: Mapping[str, Iterable[int]] | None = None) -> nnx.State:
    """Fills an abstract NNX state (from ``nnx.eval_shape``) from a tensor source.

    Every parameter must be present with the right shape; layered parameters are read one
    layer at a time into one stacked array (``layer_ids``: see :func:`layer_id`). Raises
    CheckpointError naming the missing or misshapen tensor.
    """
    overrides = dict(overrides or {})
    transposed = tuple(transposed)
    flat = _flat_params(abstract_state)
    values = {}
    for path, var in flat.items():
        shape = tuple(var.get_value().shape)
        target_dtype = dtype or var.get_value().dtype
        layered = path[0] in STACKS
        per_layer = shape[1:] if layered else shape
        count = shape[0] if layered else 1
        out = np.empty(shape, dtype=np.dtype(target_dtype))
        for i in range(count):
            key = torch_key(path, layer_id(path, i, layer_ids) if layered else None, prefix, overrides)
            if key not in source:
                raise CheckpointError(f"missing tensor {key!r} in the checkpoint")
            tensor = source.get(key)
            if transform is not None:
                tensor = transform(key, tensor)
            if is_transposed(path, transposed):
                tensor = tensor.T
            if tuple(tensor.shape) != per_layer:
                raise CheckpointError(
                    f"shape mismatch for tensor {key!r}: checkpoint has "
                    f"{tuple(tensor.T.shape) if is_transposed(path, transposed) else tuple(tensor.shape)}, "
                    f"the model expects {per_layer[::-1] if is_transposed(path, transposed) else per_layer}")
            if layered:
                out[i] = tensor.astype(out.dtype)
            else:
                out[...] = tensor.astype(out.dtype)
        values[path] = out
        if progress is not None:
            progress.update(1)
    state = jax.tree.map(lambda x: x, abstract_state)
    for path, var in nnx.to_flat_state(state):
        var.set_value(jnp.asarray(values[tuple(str(p) for p in path)]))
    return state


def iter_torch_tensors(state: nnx.State, *, prefix: str, overrides: Mapping[tuple, str] = (),
                       transposed: Iterable[tuple] = (),
                       layer_ids: Mapping[str, Iterable[int]] | None = None):
    """Yields (torch key, numpy array in torch layout) for every parameter of a state."""
    overrides = dict(overrides or {})
    for path, var in _flat_params(state).items():
        array = np.asarray(jax.device_get(var.get_value()))
        layered = path[0] in STACKS
        for i in range(array.shape[0] if layered else 1):
            tensor = array[i] if layered else array
            if is_transposed(path, transposed):
                tensor = tensor.T
            yield (torch_key(path, layer_id(path, i, layer_ids) if layered else None, prefix, overrides),
                   np.ascontiguousarray(tensor))


def write_safetensors(tensors: Mapping[str, np.ndarray], folder: Path,
                      max_shard_bytes: int = 5 * 2**30) -> None:
    """Writes tensors as ``model.safetensors`` or as shards with an index when larger."""
    total = sum(t.nbytes for t in tensors.values())
    if total <= max_shard_bytes:
        save_file(dict(tensors), str(folder / SAFETENSORS_SINGLE), metadata={"format": "pt"})
        return
    shards, current, size = [], {}, 0
    for key, tensor in tensors.items():
        if current and size + tensor.nbytes > max_shard_bytes:
            shards.append(current)
            current, size = {}, 0
        current[key] = tensor
        size += tensor.nbytes
    shards.append(current)
    weight_map = {}
    for i, shard in enumerate(shards):
        name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(folder / name), metadata={"format": "pt"})
        weight_map.update({k: name for k in shard})
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / SAFETENSORS_INDEX).write_text(json.dumps(index, indent=2))
