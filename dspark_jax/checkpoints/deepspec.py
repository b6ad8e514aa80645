"""Drafter checkpoints: DeepSpec DSpark/DFlash folders, z-lab DFlash folders, and Orbax.

Layouts (DSPARK_SPEC.md section 10):

* ``deepspec``: a Hugging Face folder as DeepSpec's ``save_pretrained`` writes it. config.json
  is the draft architecture's config (the target's, with ``num_hidden_layers`` = draft layers)
  plus architectures ["<Family>DSparkModel"], block_size, mask_token_id, target_layer_ids,
  num_target_layers, num_anchors, markov_rank, markov_head_type, enable_confidence_head,
  confidence_head_with_markov and tie_word_embeddings false. The safetensors (single or
  sharded) hold exactly the spec's keys, including copies of the target's ``embed_tokens`` and
  ``lm_head`` (ignored on import: the drafter always uses its target's; a copy that differs
  from the target's raises a warning, see ``warn_on_other_target_tensors``).
* ``dflash``: the z-lab DFlash layout: no embed_tokens / lm_head, no heads, architectures
  ["DFlashDraftModel"], ``dflash_config`` holding mask_token_id and target_layer_ids; only the
  mask slots predict unless ``dflash_config.sample_from_anchor`` is true.
* ``orbax``: the parameters saved with Orbax plus ``dspark_drafter.json`` (both configs).

Extensions, written only when used: a trainable mask vector is the extra tensor
``mask_embedding`` [d] with ``"trainable_mask_embedding": true`` (the deepspec layout also puts
it into row mask_token_id of the exported ``embed_tokens``, so the reference reader drafts the
same way); ``"anchor_predicts": false`` in a deepspec config marks a drafter whose anchor slot
does not predict.

Every mismatch with the target raises :class:`CheckpointError` naming the field.
"""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from flax import nnx

from dspark_jax import sharding, storage
from dspark_jax.checkpoints import hf, orbax_params
from dspark_jax.checkpoints.errors import CheckpointError
from dspark_jax.model_config import (FULL, GEMMA4_TYPES, MODEL_TYPES, model_config_from_hf,
                                     model_config_to_hf)
from dspark_jax.drafter_config import DEEPSPEC_HEAD_TYPES, check_fit, drafter_config
from dspark_jax.models.drafter import DSparkModel

LAYOUTS = ("deepspec", "dflash", "orbax")
ORBAX_MARKER = "dspark_drafter.json"
MASK_KEY = "mask_embedding"
OVERRIDES = {("mask_embedding",): MASK_KEY}
FAMILY_NAMES = {"llama": "Llama", "qwen2": "Qwen2", "qwen3": "Qwen3", "gemma3_text": "Gemma3",
                "gemma4_text": "Gemma4", "gemma4_unified_text": "Gemma4"}
LAYER_SCALAR = "layers.{}.layer_scalar"  # DeepSpec's Gemma4 drafter: a buffer of ones [1]
ZLAB_ARCHITECTURE = "DFlashDraftModel"
TARGET_TENSORS = ("embed_tokens.weight", "lm_head.weight")  # the deepspec layout's copies
COMPARE_ROWS = 4096  # rows per float32 chunk when a copy is compared with the target's


# ----------------------------------------------------------------------------- model config


def draft_model_config(target_config, num_layers: int) -> ml_collections.FrozenConfigDict:
    """The draft layers' architecture: the target's config with ``num_layers`` full-attention
    layers (a draft block sees its whole context, also over a sliding-window target; over
    Gemma4, with the target's full-layer shape), an untied head, no per-layer scalar
    (DeepSpec's Gemma4 drafter holds one as a buffer of ones that training never changes) and,
    over either Gemma4 family, model_type gemma4_text as DeepSpec writes it."""
    fields = target_config.as_configdict().to_dict()
    fields["num_hidden_layers"] = int(num_layers)
    fields["layer_types"] = (FULL,) * int(num_layers)
    fields["sliding_window"] = None
    fields["tie_word_embeddings"] = False  # as DeepSpec's draft config (its lm_head is a copy)
    fields["layer_scalar"] = False  # see _without_layer_scalar
    if fields["model_type"] in GEMMA4_TYPES:  # DeepSpec's Gemma4 drafter config is a Gemma4TextConfig
        fields["model_type"] = "gemma4_text"
    return ml_collections.FrozenConfigDict(fields)


def _without_layer_scalar(model_cfg) -> ml_collections.FrozenConfigDict:
    """The draft layers keep no per-layer scalar: DeepSpec's Gemma4 drafter registers one as a
    buffer of ones that training never changes; the deepspec layout writes it as such
    (:func:`drafter_tensors`) and a reader checks it (:func:`_check_layer_scalars`)."""
    if not model_cfg.layer_scalar:
        return model_cfg
    return ml_collections.FrozenConfigDict(dict(model_cfg.as_configdict().to_dict(), layer_scalar=False))


def abstract_drafter(model_cfg, cfg, dtype):
    """(graphdef, abstract state) of a DSparkModel without allocating it."""
    with sharding.unsharded_init():
        return nnx.split(nnx.eval_shape(lambda: DSparkModel(model_cfg, cfg, dtype=dtype,
                                                             rngs=nnx.Rngs(0))))


def check_target_fit(model_cfg, cfg, target_config, *, num_target_layers=None) -> None:
    """Raises CheckpointError when a drafter cannot run on the target."""
    if model_cfg.hidden_size != target_config.hidden_size:
        raise CheckpointError(
            f"the drafter's hidden size {model_cfg.hidden_size} does not match the target's "
            f"hidden size {target_config.hidden_size}")
    if model_cfg.vocab_size != target_config.vocab_size:
        raise CheckpointError(
            f"the drafter's vocabulary size {model_cfg.vocab_size} does not match the target's "
            f"vocabulary size {target_config.vocab_size}")
    if num_target_layers is not None and int(num_target_layers) != target_config.num_hidden_layers:
        raise CheckpointError(
            f"the drafter was trained for a target with {num_target_layers} layers "
            f"(num_target_layers) but the target has {target_config.num_hidden_layers}")
    check_fit(cfg, target_config, error=CheckpointError)


def _family_config(hf_config: dict, target_config) -> ml_collections.FrozenConfigDict:
    """Reads the draft architecture from a drafter config.json (any ``architectures`` name)."""
    model_type = hf_config.get("model_type")
    if model_type not in MODEL_TYPES:
        model_type = target_config.model_type
    fields = dict(hf_config, architectures=[MODEL_TYPES[model_type]], model_type=model_type)
    fields.pop("dflash_config", None)
    try:
        return _without_layer_scalar(model_config_from_hf(fields))
    except ValueError as e:
        raise CheckpointError(f"drafter config.json: {e}") from e


def _require(hf_config: dict, key: str, where: str = "config.json"):
    if key not in hf_config:
        raise CheckpointError(f"drafter {where} lacks the field {key!r}")
    return hf_config[key]


def parse_hf_config(hf_config: dict, target_config):
    """(layout, draft model config, drafter config, num_target_layers) of a config.json."""
    model_cfg = _family_config(hf_config, target_config)
    trainable = bool(hf_config.get("trainable_mask_embedding", False))
    try:
        if "dflash_config" in hf_config:
            dflash = hf_config["dflash_config"] or {}
            cfg = drafter_config(
                block_size=hf_config.get("block_size", dflash.get("block_size", 16)),
                num_layers=model_cfg.num_hidden_layers, markov_rank=0, head="none",
                target_layer_ids=_require(dflash, "target_layer_ids", "dflash_config"),
                mask_token_id=dflash.get("mask_token_id", hf_config.get("mask_token_id")),
                trainable_mask_embedding=trainable, confidence_head=False,
                anchor_predicts=bool(dflash.get("sample_from_anchor", False)))
            return "dflash", model_cfg, cfg, hf_config.get("num_target_layers")
        rank = int(hf_config.get("markov_rank", 0))
        head_type = hf_config.get("markov_head_type", "vanilla")
        heads = {v: k for k, v in DEEPSPEC_HEAD_TYPES.items()}
        if rank > 0 and head_type not in heads:
            raise CheckpointError(f"unsupported markov_head_type {head_type!r}; supported: "
                                  f"{', '.join(heads)}")
        cfg = drafter_config(
            block_size=_require(hf_config, "block_size"),
            num_layers=model_cfg.num_hidden_layers, markov_rank=rank,
            head=heads[head_type] if rank > 0 else "none",
            target_layer_ids=_require(hf_config, "target_layer_ids"),
            mask_token_id=_require(hf_config, "mask_token_id"),
            trainable_mask_embedding=trainable,
            confidence_head=bool(hf_config.get("enable_confidence_head", False)),
            confidence_head_with_markov=bool(hf_config.get("confidence_head_with_markov", rank > 0)),
            anchor_predicts=bool(hf_config.get("anchor_predicts", True)))
    except CheckpointError:
        raise
    except ValueError as e:
        raise CheckpointError(f"invalid drafter config.json: {e}") from e
    return "deepspec", model_cfg, cfg, hf_config.get("num_target_layers")


def hf_config_for(layout: str, model_cfg, cfg, target_config, num_anchors: int | None = None) -> dict:
    """The config.json of a drafter in the ``deepspec`` or ``dflash`` layout.

    ``num_anchors``: the training setting DeepSpec keeps in its drafter config (anchors per
    training sequence), written when given; dspark-jax reads it from the train config instead.
    """
    out = model_config_to_hf(model_cfg)
    out["tie_word_embeddings"] = False
    out["num_target_layers"] = target_config.num_hidden_layers
    if cfg.trainable_mask_embedding:
        out["trainable_mask_embedding"] = True
    if layout == "dflash":
        out["architectures"] = [ZLAB_ARCHITECTURE]
        out["block_size"] = cfg.block_size
        out["dflash_config"] = dict(mask_token_id=cfg.mask_token_id,
                                    target_layer_ids=list(cfg.target_layer_ids))
        if cfg.anchor_predicts:
            out["dflash_config"]["sample_from_anchor"] = True
        return out
    out.update(
        architectures=[f"{FAMILY_NAMES[model_cfg.model_type]}DSparkModel"],
        block_size=cfg.block_size, mask_token_id=cfg.mask_token_id,
        target_layer_ids=list(cfg.target_layer_ids), markov_rank=cfg.markov_rank,
        markov_head_type=DEEPSPEC_HEAD_TYPES.get(cfg.head, "vanilla"),
        enable_confidence_head=cfg.confidence_head,
        confidence_head_with_markov=cfg.confidence_head_with_markov)
    if num_anchors is not None:
        out["num_anchors"] = int(num_anchors)
    if not cfg.anchor_predicts:
        out["anchor_predicts"] = False
    return out


# ----------------------------------------------------------------------------- tensors


def drafter_tensors(layout: str, cfg, state: nnx.State, target_state: nnx.State | None,
                    target_config):
    """{torch key: numpy array} of a drafter in the ``deepspec`` or ``dflash`` layout.

    The deepspec layout adds the target's embedding and LM head (read from ``target_state``;
    ``target_state=None`` leaves them out: a compact folder that only dspark-jax reads, since
    it takes them from the target anyway).
    """
    tensors = dict(hf.iter_torch_tensors(state, prefix="", overrides=OVERRIDES))
    if layout == "deepspec" and target_config.layer_scalar:
        dtype = tensors["fc.weight"].dtype
        tensors.update({LAYER_SCALAR.format(i): np.ones((1,), dtype) for i in range(cfg.num_layers)})
    if layout == "deepspec" and target_state is not None:
        embed = np.array(target_tensor("embed_tokens.weight", target_state, target_config))
        if cfg.trainable_mask_embedding:
            embed[cfg.mask_token_id] = tensors[MASK_KEY].astype(embed.dtype)
        tensors["embed_tokens.weight"] = np.ascontiguousarray(embed)
        tensors["lm_head.weight"] = np.ascontiguousarray(
            target_tensor("lm_head.weight", target_state, target_config))
    return tensors


def target_tensor(key: str, target_state: nnx.State, target_config) -> np.ndarray:
    """The target's tensor that the deepspec layout copies as ``key`` (one of TARGET_TENSORS),
    in torch layout [vocab, d]; the LM head is the embedding for tied targets."""
    flat = {tuple(str(p) for p in path): v.get_value()
            for path, v in nnx.to_flat_state(target_state)}
    if key == "embed_tokens.weight" or target_config.tie_word_embeddings:
        return np.asarray(jax.device_get(flat[("embed_tokens", "embedding")]))
    return np.asarray(jax.device_get(flat[("lm_head",)])).T


def _largest_difference(saved: np.ndarray, expected: np.ndarray, skip_row: int | None) -> float:
    """The largest |saved - expected| over the elements that differ by more than the coarser
    dtype's rounding (relative eps, so a bfloat16 copy of a float32 tensor agrees); 0.0 when
    all agree, inf for different shapes. Row ``skip_row`` is not compared."""
    if saved.shape != expected.shape:
        return float("inf")
    eps = max(float(jnp.finfo(saved.dtype).eps), float(jnp.finfo(expected.dtype).eps))
    tiny = max(float(jnp.finfo(saved.dtype).smallest_normal),
               float(jnp.finfo(expected.dtype).smallest_normal))
    largest = 0.0
    for start in range(0, len(saved), COMPARE_ROWS):
        a = saved[start:start + COMPARE_ROWS].astype(np.float32)
        b = expected[start:start + COMPARE_ROWS].astype(np.float32)
        if skip_row is not None and start <= skip_row < start + len(a):
            a[skip_row - start] = b[skip_row - start]
        gap = np.abs(a - b)
        beyond = gap[gap > tiny + eps * np.abs(b)]
        largest = max(largest, float(beyond.max(initial=0.0)))
    return largest


def warn_on_other_target_tensors(folder: str | os.PathLike, cfg, target_state: nnx.State,
                                 target_config) -> None:
    """Warns when a drafter folder's copies of embed_tokens / lm_head differ from the target's.

    The drafter always uses its target's embedding and LM head, so a different copy means the
    drafter was trained with other ones (another target, or another precision of it) and may
    draft worse than its checkpoint promises. Absent copies (the dflash layout, compact deepspec
    folders) are fine. With a trainable mask embedding the mask token's row is not compared:
    the deepspec layout writes the mask vector into embed_tokens there (and exports of tied
    targets written before the LM head got its own copy, into lm_head too).
    """
    source = hf.SafetensorsFolder(folder)
    skip_row = cfg.mask_token_id if cfg.trainable_mask_embedding else None
    for key in TARGET_TENSORS:
        if key not in source:
            continue
        expected = target_tensor(key, target_state, target_config)
        largest = _largest_difference(source.get(key), expected, skip_row)
        if largest > 0:
            name = key.removesuffix(".weight")
            warnings.warn(
                f"drafter checkpoint {folder}: its {key} differs from the target's (largest "
                f"difference {largest:.3g}, beyond rounding); the drafter uses the target's "
                f"{name} and ignores the checkpoint's copy, so it may have been trained for "
                "another target", stacklevel=3)


def tensor_shapes(layout: str, cfg, state: nnx.State, target_config) -> dict[str, tuple[int, ...]]:
    """{torch key: torch-layout shape} that ``drafter_tensors`` writes, from a (possibly
    abstract, ``nnx.eval_shape``) drafter state: the names without allocating the weights."""
    shapes = {}
    for path, var in hf._flat_params(state).items():
        shape = tuple(var.get_value().shape)
        layered = path[0] == "layers"
        per_layer = shape[1:] if layered else shape
        if hf.is_transposed(path):
            per_layer = per_layer[::-1]
        for i in range(shape[0] if layered else 1):
            shapes[hf.torch_key(path, i if layered else None, "", OVERRIDES)] = per_layer
    if layout == "deepspec":
        vocab_by_hidden = (target_config.vocab_size, target_config.hidden_size)
        shapes["embed_tokens.weight"] = shapes["lm_head.weight"] = vocab_by_hidden
        if target_config.layer_scalar:
            shapes.update({LAYER_SCALAR.format(i): (1,) for i in range(cfg.num_layers)})
    return shapes


def _check_layer_scalars(source: hf.TensorSource, num_layers: int) -> None:
    """A deepspec folder's per-layer scalars (Gemma4) must be the ones DeepSpec never trains."""
    for i in range(num_layers):
        key = LAYER_SCALAR.format(i)
        if key in source and not np.all(np.asarray(source.get(key), np.float32) == 1.0):
            raise CheckpointError(
                f"the drafter's {key} is {np.asarray(source.get(key)).tolist()}, not 1: DeepSpec's "
                "drafters keep it at 1 and dspark-jax draft layers have no per-layer scalar")


def _check_heads(cfg, source: hf.TensorSource) -> None:
    keys = set(source.keys())
    has_markov = any(k.startswith("markov_head.") for k in keys)
    has_confidence = any(k.startswith("confidence_head.") for k in keys)
    if cfg.markov_rank > 0 and not has_markov:
        raise CheckpointError(
            f"the config declares a {cfg.head!r} Markov head of rank {cfg.markov_rank} "
            "(markov_rank) but the checkpoint has no markov_head.* tensors")
    if cfg.markov_rank == 0 and has_markov:
        raise CheckpointError("the checkpoint has markov_head.* tensors but the config has "
                              "markov_rank 0 (no Markov head)")
    if cfg.confidence_head and not has_confidence:
        raise CheckpointError("the config enables the confidence head (enable_confidence_head) "
                              "but the checkpoint has no confidence_head.* tensors")
    if cfg.trainable_mask_embedding and MASK_KEY not in keys:
        raise CheckpointError("the config declares a trainable mask embedding but the checkpoint "
                              f"has no {MASK_KEY!r} tensor")


# ----------------------------------------------------------------------------- folders


def detect_layout(folder: str | os.PathLike) -> str:
    """'orbax', 'dflash' or 'deepspec' for a drafter folder."""
    folder = Path(folder)
    if (folder / ORBAX_MARKER).exists():
        return "orbax"
    config = folder / "config.json"
    if not config.exists():
        raise CheckpointError(f"{folder} is not a drafter checkpoint (no config.json or {ORBAX_MARKER})")
    return "dflash" if "dflash_config" in _read_json(config) else "deepspec"


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"corrupt {path.name} in {path.parent}: {e}") from e


def save(folder: str | os.PathLike, *, layout: str, model_cfg, cfg, state: nnx.State,
         target_state: nnx.State | None, target_config,
         extra_files: dict[str, str] | None = None, num_anchors: int | None = None) -> storage.AnyPath:
    """Writes a drafter folder atomically in one of ``LAYOUTS`` (``target_state=None``: the
    deepspec layout without the target's embedding and LM head); ``extra_files`` {name: text}
    are written into the folder too (e.g. the calibration); ``num_anchors`` as in
    :func:`hf_config_for`."""
    if layout not in LAYOUTS:
        raise ValueError(f"unknown layout {layout!r}; choose one of {', '.join(LAYOUTS)}")
    if layout == "dflash" and (cfg.markov_rank > 0 or cfg.confidence_head):
        raise CheckpointError(
            "the dflash layout has no Markov or confidence head; this drafter has "
            f"head={cfg.head!r}, confidence_head={cfg.confidence_head}: use layout='deepspec'")
    dtype = str(np.dtype(nnx.to_flat_state(state)[0][1].get_value().dtype))

    def write(tmp: Path):
        for name, text in (extra_files or {}).items():
            (tmp / name).write_text(text)
        if layout == "orbax":
            orbax_params.save_params(tmp, state)
            meta = dict(drafter_config=_plain(cfg), model_config=model_config_to_hf(model_cfg),
                        num_target_layers=target_config.num_hidden_layers, dtype=dtype)
            (tmp / ORBAX_MARKER).write_text(json.dumps(meta, indent=2))
            return
        hf_config = hf_config_for(layout, model_cfg, cfg, target_config, num_anchors)
        hf_config["torch_dtype"] = hf_config["dtype"] = dtype
        (tmp / "config.json").write_text(json.dumps(hf_config, indent=2))
        hf.write_safetensors(drafter_tensors(layout, cfg, state, target_state, target_config), tmp)

    return storage.write_folder(folder, write,
                                marker=ORBAX_MARKER if layout == "orbax" else "config.json")


def _plain(cfg) -> dict:
    fields = cfg.as_configdict().to_dict()
    fields["target_layer_ids"] = list(fields["target_layer_ids"])
    return fields


def load(folder: str | os.PathLike, target_config, dtype=None):
    """Reads any drafter layout; returns (model_cfg, cfg, graphdef, state).

    ``dtype`` is the parameter dtype (default: float32 for Hugging Face folders, the saved
    dtype for Orbax folders).

    Raises:
      CheckpointError: unreadable folder, or a drafter that does not fit the target (hidden
        size, vocabulary, tapped layer ids, number of target layers) or lacks declared heads.
    """
    folder = Path(folder)
    layout = detect_layout(folder)
    if layout == "orbax":
        return _load_orbax(folder, target_config, dtype)
    _, model_cfg, cfg, num_target_layers = parse_hf_config(_read_json(folder / "config.json"),
                                                          target_config)
    check_target_fit(model_cfg, cfg, target_config, num_target_layers=num_target_layers)
    source = hf.SafetensorsFolder(folder)
    _check_heads(cfg, source)
    _check_layer_scalars(source, cfg.num_layers)
    dtype = dtype or jnp.float32
    graphdef, abstract = abstract_drafter(model_cfg, cfg, dtype)
    state = hf.load_params(abstract, source, prefix="", overrides=OVERRIDES, dtype=dtype)
    return model_cfg, cfg, graphdef, state


def _load_orbax(folder: Path, target_config, dtype):
    meta = _read_json(folder / ORBAX_MARKER)
    try:
        model_cfg = _without_layer_scalar(model_config_from_hf(meta["model_config"]))
        # Folders written before 2026-12-02 also hold num_anchors, now a train setting.
        cfg = drafter_config(**{k: v for k, v in meta["drafter_config"].items() if k != "num_anchors"})
    except (KeyError, ValueError) as e:
        raise CheckpointError(f"invalid {ORBAX_MARKER} in {folder}: {e}") from e
    check_target_fit(model_cfg, cfg, target_config, num_target_layers=meta.get("num_target_layers"))
    dtype = dtype or jnp.dtype(meta["dtype"])
    graphdef, abstract = abstract_drafter(model_cfg, cfg, dtype)
    return model_cfg, cfg, graphdef, orbax_params.restore_params(folder, abstract, dtype)


__all__ = ["LAYOUTS", "abstract_drafter", "check_target_fit", "detect_layout",
           "draft_model_config", "drafter_tensors", "hf_config_for", "load", "parse_hf_config",
           "save", "target_tensor", "warn_on_other_target_tensors"]
