"""Model configuration: Hugging Face ``config.json`` <-> one frozen ml-collections schema.

The target decoder family (Llama, Qwen2, Qwen3) is described by a single
``ml_collections.FrozenConfigDict`` with the Hugging Face field names (``vocab_size``,
``hidden_size``, ``num_hidden_layers``, ...) plus three derived switches that say where the
families differ: ``qkv_bias`` (Qwen2), ``o_bias`` (Llama/Qwen3 ``attention_bias``) and
``qk_norm`` (Qwen3). Frozen configs are hashable, so they serve as static arguments of jitted
functions.
"""

from __future__ import annotations

from typing import Any, Mapping

import ml_collections

ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}
MODEL_TYPES = {v: k for k, v in ARCHITECTURES.items()}
ROPE_TYPES = ("default", "linear", "llama3", "yarn")


class UnsupportedModelError(ValueError):
    """The checkpoint's architecture or one of its options is not implemented here."""


def _rope_from_hf(hf: Mapping[str, Any]) -> tuple[float, dict]:
    """Returns (rope_theta, scaling dict with 'rope_type') from either HF config generation.

    transformers < 5 writes ``rope_theta`` and ``rope_scaling`` ({"type"|"rope_type": ...});
    transformers >= 5 writes ``rope_parameters`` holding both.
    """
    params = dict(hf.get("rope_parameters") or {})
    theta = params.pop("rope_theta", hf.get("rope_theta", 10000.0))
    scaling = dict(hf.get("rope_scaling") or {}) or params
    rope_type = scaling.pop("rope_type", None) or scaling.pop("type", None) or "default"
    scaling.pop("type", None)
    if rope_type not in ROPE_TYPES:
        raise UnsupportedModelError(
            f"unsupported rope scaling type {rope_type!r}; supported: {', '.join(ROPE_TYPES)}"
        )
    scaling["rope_type"] = rope_type
    return float(theta), scaling


def model_config_from_hf(hf: Mapping[str, Any]) -> ml_collections.FrozenConfigDict:
    """Builds the frozen model config from a Hugging Face config dict.

    Raises:
      UnsupportedModelError: unknown architecture, sliding-window attention, or an unsupported
        rope scaling type.
    """
    archs = list(hf.get("architectures") or [])
    model_type = hf.get("model_type")
    if archs and archs[0] not in ARCHITECTURES:
        raise UnsupportedModelError(
            f"unsupported architecture {archs[0]!r}; supported: {', '.join(ARCHITECTURES)}"
        )
    if archs:
        model_type = ARCHITECTURES[archs[0]]
    if model_type not in MODEL_TYPES:
        raise UnsupportedModelError(
            f"unsupported model_type {model_type!r}; supported: {', '.join(MODEL_TYPES)}"
        )
    if hf.get("use_sliding_window"):
        raise UnsupportedModelError("sliding-window attention (use_sliding_window) is not supported")
    if hf.get("hidden_act", "silu") != "silu":
        raise UnsupportedModelError(f"unsupported hidden_act {hf.get('hidden_act')!r}; only silu")
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                "num_attention_heads"):
        if key not in hf:
            raise UnsupportedModelError(f"config.json lacks the field {key!r}")

    theta, scaling = _rope_from_hf(hf)
    heads = int(hf["num_attention_heads"])
    head_dim = hf.get("head_dim") or hf["hidden_size"] // heads
    attention_bias = bool(hf.get("attention_bias", False))
    eos = hf.get("eos_token_id")
    eos = tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (int(eos),))
    return ml_collections.FrozenConfigDict(
        dict(
            model_type=model_type,
            vocab_size=int(hf["vocab_size"]),
            hidden_size=int(hf["hidden_size"]),
            intermediate_size=int(hf["intermediate_size"]),
            num_hidden_layers=int(hf["num_hidden_layers"]),
            num_attention_heads=heads,
            num_key_value_heads=int(hf.get("num_key_value_heads") or heads),
            head_dim=int(head_dim),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=int(hf.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            attention_bias=attention_bias,
            mlp_bias=bool(hf.get("mlp_bias", False)),
            qkv_bias=model_type == "qwen2" or attention_bias,
            o_bias=model_type != "qwen2" and attention_bias,
            qk_norm=model_type == "qwen3",
            bos_token_id=hf.get("bos_token_id"),
            eos_token_id=eos,
            pad_token_id=hf.get("pad_token_id"),
        )
    )


def model_config_to_hf(cfg: ml_collections.FrozenConfigDict) -> dict:
    """The Hugging Face config.json dict that transformers loads for this model."""
    scaling = dict(cfg.rope_scaling)
    rope_type = scaling.get("rope_type", "default")
    hf = dict(
        architectures=[MODEL_TYPES[cfg.model_type]],
        model_type=cfg.model_type,
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_hidden_layers,
        num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads,
        head_dim=cfg.head_dim,
        hidden_act="silu",
        rms_norm_eps=cfg.rms_norm_eps,
        rope_theta=cfg.rope_theta,
        rope_scaling=None if rope_type == "default" else scaling,
        max_position_embeddings=cfg.max_position_embeddings,
        tie_word_embeddings=cfg.tie_word_embeddings,
        bos_token_id=cfg.bos_token_id,
        eos_token_id=list(cfg.eos_token_id) if len(cfg.eos_token_id) != 1 else cfg.eos_token_id[0],
        pad_token_id=cfg.pad_token_id,
    )
    if cfg.model_type != "qwen2":
        hf["attention_bias"] = cfg.attention_bias
    if cfg.model_type == "llama":
        hf["mlp_bias"] = cfg.mlp_bias
    return hf
