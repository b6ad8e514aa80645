"""The loaded target model: config, tokenizer and parameters, and how to load and export it.

``load_target(source)`` accepts a registered name (``smollm2-135m-instruct``), a Hugging Face
folder, a GGUF file or an Orbax folder written by ``Target.save_orbax``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from flax import nnx
from tqdm.auto import tqdm

from dspark_jax.checkpoints import hf, orbax_params, registry
from dspark_jax.checkpoints.errors import CheckpointError
from dspark_jax.checkpoints.gguf import GGUFFile, write_gguf
from dspark_jax.model_config import (layer_groups, model_config_from_hf, model_config_to_hf,
                                     text_model_hf)
from dspark_jax.models import layer_weights
from dspark_jax.models.decoder import Decoder
from dspark_jax import sharding, storage

# Target checkpoints keep transformers' names: "model." prefix, lm_head outside it.
HF_PREFIX = "model."
HF_OVERRIDES = {("lm_head",): "lm_head.weight"}
# Multimodal Gemma folders (``model_config.MULTIMODAL``): the text model's tensors under one of
# these prefixes (transformers 5 writes the first, Gemma3's original checkpoints have the
# second) -> the key of its LM head when untied.
MULTIMODAL_PREFIXES = {"model.language_model.": "lm_head.weight",
                       "language_model.model.": "language_model.lm_head.weight"}
HF_TRANSPOSED = (("lm_head",),)
ORBAX_MARKER = "dspark_target.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def default_dtype():
    """float32 on CPU (XLA's CPU bfloat16 matmuls are slow), bfloat16 on TPU/GPU."""
    return jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16


class Target:
    """A loaded target decoder.

    Attributes:
      config: FrozenConfigDict with Hugging Face field names (vocab_size, hidden_size, ...).
      tokenizer: transformers tokenizer with the chat template, or None.
      graphdef, state: the split NNX model (``nnx.merge(graphdef, state)`` inside jit).
      hf_config: the config.json dict the model came from.
    """

    def __init__(self, config, state: nnx.State, graphdef, tokenizer=None, hf_config=None,
                 name: str = ""):
        self.config = config
        self.state = state
        self.graphdef = graphdef
        self.tokenizer = tokenizer
        self.hf_config = dict(hf_config or model_config_to_hf(config))
        self.name = name
        self._logits_fn = jax.jit(self._logits_impl)
        self._layouts = layer_weights.Layouts(("layers", "global_layers"))

    def __repr__(self):
        c = self.config
        return (f"Target({self.name or c.model_type}: {c.num_hidden_layers} layers, "
                f"d={c.hidden_size}, V={c.vocab_size}, {np.dtype(self.dtype).name})")

    @property
    def dtype(self):
        """Parameter dtype."""
        return self.state["embed_tokens"]["embedding"].get_value().dtype

    def inference_state(self, layout: str, weight_dtype=None) -> nnx.State:
        """The state that decoding programs take: the layer stacks' weight matrices held one
        array per layer (``layer_weights``, layout "unstacked": XLA:CPU's layer scan then reads
        them in place instead of copying them each step, at the cost of one more copy of them in
        memory for as long as the target lives) or as :attr:`state` ("stacked"); with
        ``weight_dtype`` (e.g. bfloat16; None: the parameter dtype) the weight matrices in that
        dtype under the parameter dtype's activations (``layer_weights.with_dtype``). Made once
        per :attr:`state`, layout and dtype (``layer_weights.Layouts``: a new :attr:`state` is
        followed, an in-place change of its arrays is not)."""
        return self._layouts.get(self.state, layout, weight_dtype)

    @property
    def model(self) -> Decoder:
        return nnx.merge(self.graphdef, self.state)

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        ids = set(self.config.eos_token_id)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            ids.add(int(self.tokenizer.eos_token_id))
        return tuple(sorted(ids))

    def _logits_impl(self, state, input_ids, key_valid):
        model = nnx.merge(self.graphdef, state)
        positions = jnp.broadcast_to(jnp.arange(input_ids.shape[1]), input_ids.shape)
        return model.logits(model(input_ids, positions, key_valid=key_valid).hidden)

    def check_token_ids(self, ids: np.ndarray) -> None:
        if ids.size and (ids.min() < 0 or ids.max() >= self.config.vocab_size):
            raise ValueError(
                f"token id {int(ids.max() if ids.max() >= self.config.vocab_size else ids.min())} "
                f"is outside the vocabulary of size {self.config.vocab_size} (wrong vocabulary?)")

    def logits(self, input_ids, attention_mask=None) -> np.ndarray:
        """int [B, T] -> float32 numpy logits [B, T, V].

        ``attention_mask`` [B, T] (1 = real token) marks right padding; padded keys are masked.
        """
        ids = np.asarray(input_ids)
        if ids.ndim != 2:
            raise ValueError(f"input_ids must be [batch, length], got shape {ids.shape}")
        self.check_token_ids(ids)
        valid = np.ones(ids.shape, bool) if attention_mask is None else np.asarray(attention_mask, bool)
        return np.asarray(self._logits_fn(self.state, jnp.asarray(ids, jnp.int32), jnp.asarray(valid)))

    # -- export ---------------------------------------------------------------------------

    def torch_tensors(self):
        return hf.iter_torch_tensors(self.state, prefix=HF_PREFIX, overrides=HF_OVERRIDES,
                                     transposed=HF_TRANSPOSED, layer_ids=layer_ids(self.config))

    def save_hf(self, folder: str | os.PathLike) -> storage.AnyPath:
        """Writes a Hugging Face folder (config.json, safetensors, tokenizer) atomically."""
        def write(tmp: Path):
            hf_config = dict(self.hf_config)
            for key in ("rope_parameters", "per_layer_config"):  # written again where used
                hf_config.pop(key, None)
            hf_config.update(model_config_to_hf(self.config))
            hf_config.pop("quantization_config", None)
            hf_config["torch_dtype"] = hf_config["dtype"] = str(np.dtype(self.dtype))
            (tmp / "config.json").write_text(json.dumps(hf_config, indent=2))
            hf.write_safetensors(dict(self.torch_tensors()), tmp)
            if self.tokenizer is not None:
                self.tokenizer.save_pretrained(tmp)
        return storage.write_folder(folder, write)

    def save_gguf(self, path: str | os.PathLike) -> storage.AnyPath:
        """Writes a float32 GGUF file (llama.cpp layout, q/k rows permuted for Llama)."""
        return write_gguf(self, path)

    def save_orbax(self, folder: str | os.PathLike) -> storage.AnyPath:
        """Writes the parameters with Orbax plus config and tokenizer, atomically."""
        def write(tmp: Path):
            orbax_params.save_params(tmp, self.state)
            (tmp / ORBAX_MARKER).write_text(json.dumps(
                {"hf_config": {**self.hf_config, **model_config_to_hf(self.config)},
                 "dtype": str(np.dtype(self.dtype))}, indent=2))
            if self.tokenizer is not None:
                self.tokenizer.save_pretrained(tmp)
        return storage.write_folder(folder, write, marker=ORBAX_MARKER)


# ----------------------------------------------------------------------------- loading


def abstract_model(config, dtype):
    """(graphdef, abstract state) of a Decoder without allocating its weights."""
    with sharding.unsharded_init():
        model = nnx.eval_shape(lambda: Decoder(config, dtype=dtype, rngs=nnx.Rngs(0)))
    return nnx.split(model)


def init_target(hf_config: dict, *, dtype=None, seed: int = 0, tokenizer=None) -> Target:
    """A randomly initialised target of the given config (tests, benchmarks), placed on the
    current mesh like a loaded one."""
    config = model_config_from_hf(hf_config)
    dtype = dtype or default_dtype()
    with sharding.unsharded_init():
        graphdef, state = nnx.split(Decoder(config, dtype=dtype, rngs=nnx.Rngs(seed)))
    return Target(config, sharding.shard_state(state), graphdef, tokenizer=tokenizer,
                  hf_config=hf_config)


def layer_ids(config) -> dict[str, tuple[int, ...]]:
    """The layer ids of each stack of the decoder (``hf.layer_id``)."""
    return dict(zip(hf.STACKS, layer_groups(config)))


def _load_tokenizer(folder: Path):
    if not any((folder / f).exists() for f in TOKENIZER_FILES):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(folder))


def _from_source(hf_config: dict, source: hf.TensorSource, dtype, tokenizer, name,
                 prefix: str = HF_PREFIX, overrides=HF_OVERRIDES) -> Target:
    config = model_config_from_hf(hf_config)
    dtype = dtype or default_dtype()
    graphdef, abstract = abstract_model(config, dtype)
    count = len(nnx.to_flat_state(abstract))
    with tqdm(total=count, desc=f"loading {name}", unit="tensor", leave=False,
              disable=count < 8) as bar:
        state = hf.load_params(abstract, source, prefix=prefix, overrides=overrides,
                               transposed=HF_TRANSPOSED, dtype=dtype, progress=bar,
                               layer_ids=layer_ids(config))
    state = sharding.shard_state(state)
    return Target(config, state, graphdef, tokenizer=tokenizer, hf_config=hf_config, name=name)


def _hf_folder_config(folder: Path) -> dict:
    """The config.json dict of a Hugging Face model folder."""
    config_path = folder / "config.json"
    if not config_path.exists():
        raise CheckpointError(f"{folder} has no config.json (not a Hugging Face model folder)")
    try:
        return json.loads(config_path.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"corrupt config.json in {folder}: {e}") from e


def load_hf_folder(folder: str | os.PathLike, dtype=None) -> Target:
    """A Hugging Face folder: a causal LM, or the text model of a multimodal Gemma checkpoint
    (which then exports as a text-only causal LM)."""
    folder = Path(folder)
    hf_config = _hf_folder_config(folder)
    text = text_model_hf(hf_config)
    model_config_from_hf(text or hf_config)  # architecture errors before touching the weights
    source = hf.SafetensorsFolder(folder)
    prefix, overrides = HF_PREFIX, HF_OVERRIDES
    if text is not None:
        prefix = next((p for p in MULTIMODAL_PREFIXES if p + "embed_tokens.weight" in source), None)
        if prefix is None:
            raise CheckpointError(
                f"{folder}: a {hf_config['architectures'][0]} folder without its text model's "
                f"tensors ({' or '.join(p + 'embed_tokens.weight' for p in MULTIMODAL_PREFIXES)})")
        overrides = {("lm_head",): MULTIMODAL_PREFIXES[prefix]}
    return _from_source(text or hf_config, source, dtype, _load_tokenizer(folder), folder.name,
                        prefix, overrides)


def load_gguf(path: str | os.PathLike, dtype=None) -> Target:
    gguf = GGUFFile(path)
    return _from_source(gguf.hf_config(), gguf, dtype, gguf.tokenizer(), Path(path).stem)


def load_orbax(folder: str | os.PathLike, dtype=None) -> Target:
    folder = Path(folder)
    meta = json.loads((folder / ORBAX_MARKER).read_text())
    config = model_config_from_hf(meta["hf_config"])
    dtype = dtype or jnp.dtype(meta["dtype"])
    graphdef, abstract = abstract_model(config, dtype)
    state = orbax_params.restore_params(folder, abstract, dtype)
    return Target(config, sharding.shard_state(state), graphdef, tokenizer=_load_tokenizer(folder),
                  hf_config=meta["hf_config"], name=folder.name)


def load_registered(name: str, dtype=None) -> Target:
    folder = registry.converted_folder(name)
    if not (folder / "config.json").exists():
        gguf_path = registry.registered_file(name)
        print(f"[dspark-jax] converting {gguf_path.name} once into {folder}")
        load_gguf(gguf_path, dtype=jnp.float32).save_hf(folder)
    target = load_hf_folder(folder, dtype=dtype)
    target.name = name
    return target


def _source_kind(source: str | os.PathLike) -> tuple[str, str | Path]:
    """("registered", name), ("gguf", path), ("orbax", path) or ("hf", path) of a target source
    (an object-store URI, gs://..., names the local copy it is fetched into).

    Raises:
      CheckpointError: none of those (e.g. a Hugging Face hub id: nothing is downloaded).
    """
    text = str(source)
    if text in registry.REGISTRY:
        return "registered", text
    if storage.is_remote(text):  # read from this host's local copy
        return _source_kind(storage.local_copy(text) if text.endswith(".gguf")
                            else storage.local_folder(text))
    path = Path(text).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return "gguf", path
    if path.is_dir() and (path / ORBAX_MARKER).exists():
        return "orbax", path
    if path.is_dir():
        return "hf", path
    raise CheckpointError(
        f"unknown model {text!r}: not a registered name ({', '.join(registry.REGISTRY)}), "
        "a Hugging Face folder, an Orbax folder or a .gguf file")


def load_target(source: str | os.PathLike, dtype=None) -> Target:
    """Loads a target model.

    Args:
      source: a registered name (see ``dspark_jax.checkpoints.registry.REGISTRY``), a Hugging
        Face folder (config.json + safetensors + tokenizer), a ``.gguf`` file, or an Orbax folder
        written by ``dspark-jax convert --to orbax``.
      dtype: parameter/compute dtype; default float32 on CPU, bfloat16 on accelerators.
    """
    kind, where = _source_kind(source)
    load = {"registered": load_registered, "gguf": load_gguf, "orbax": load_orbax,
            "hf": load_hf_folder}[kind]
    return load(where, dtype)


def load_target_config(source: str | os.PathLike) -> ml_collections.FrozenConfigDict:
    """The model config of a target source (as ``load_target`` takes it), read from its
    config.json, GGUF header or Orbax metadata without touching the weights."""
    kind, where = _source_kind(source)
    if kind == "registered":
        folder = registry.converted_folder(where)
        if (folder / "config.json").exists():
            return model_config_from_hf(_hf_folder_config(folder))
        return model_config_from_hf(GGUFFile(registry.registered_file(where)).hf_config())
    if kind == "gguf":
        return model_config_from_hf(GGUFFile(where).hf_config())
    if kind == "orbax":
        return model_config_from_hf(json.loads((where / ORBAX_MARKER).read_text())["hf_config"])
    hf_config = _hf_folder_config(where)
    return model_config_from_hf(text_model_hf(hf_config) or hf_config)
