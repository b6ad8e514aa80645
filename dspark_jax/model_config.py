"""Model configuration: Hugging Face ``config.json`` <-> one frozen ml-collections schema.

The target decoder family (Llama, Qwen2, Qwen3, Gemma3) is described by a single
``ml_collections.FrozenConfigDict`` with the Hugging Face field names (``vocab_size``,
``hidden_size``, ``num_hidden_layers``, ...) plus derived switches that say where the families
differ:

* ``qkv_bias`` (Qwen2), ``o_bias`` (Llama/Qwen3 ``attention_bias``), ``qk_norm`` (Qwen3, Gemma3);
* Gemma3's: ``norm_offset`` (1.0: an RMSNorm scales by 1 + weight), ``embed_scale`` (embeddings
  times sqrt(hidden_size)), ``sandwich_norms`` (the attention and MLP outputs are normed before
  the residual add, and the MLP input by ``pre_feedforward_layernorm``), ``hidden_act``
  (``gelu_pytorch_tanh``), ``query_pre_attn_scalar`` (scores scaled by its -1/2 power; head_dim
  elsewhere), ``final_logit_softcapping`` (logits cap * tanh(x / cap); None is off; like
  transformers' Gemma3 we read no ``attn_logit_softcapping``: its attention never applies it),
  ``layer_types`` ("full_attention" / "sliding_attention" per layer), ``sliding_window``
  (a sliding layer's query sees the keys of its last ``sliding_window`` positions) and the
  sliding layers' own rope (``local_rope_theta``, ``local_rope_scaling``).

Frozen configs are hashable, so they serve as static arguments of jitted functions.
"""

from __future__ import annotations

from typing import Any, Mapping

import ml_collections

ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Gemma3ForCausalLM": "gemma3_text",
}
MODEL_TYPES = {v: k for k, v in ARCHITECTURES.items()}
ROPE_TYPES = ("default", "linear", "llama3", "yarn")
HIDDEN_ACTS = ("silu", "gelu_pytorch_tanh")
FULL, SLIDING = "full_attention", "sliding_attention"
GEMMA_THETA = {FULL: 1_000_000.0, SLIDING: 10_000.0}  # transformers' Gemma3 defaults


class UnsupportedModelError(ValueError):
    """The checkpoint's architecture or one of its options is not implemented here."""


def _rope_from_hf(hf: Mapping[str, Any]) -> tuple[float, dict]:
    """Returns (rope_theta, scaling dict with 'rope_type') from either HF config generation.

    transformers < 5 writes ``rope_theta`` and ``rope_scaling`` ({"type"|"rope_type": ...});
    transformers >= 5 writes ``rope_parameters`` holding both.
    """
    params = dict(hf.get("rope_parameters") or {})
    theta = params.pop("rope_theta", hf.get("rope_theta", 10000.0))
    return float(theta), _rope_scaling(dict(hf.get("rope_scaling") or {}) or params)


def _gemma_rope_from_hf(hf: Mapping[str, Any], layer_type: str) -> tuple[float, dict]:
    """(rope_theta, scaling) of one Gemma3 layer type, from ``rope_parameters[layer_type]``
    (transformers >= 5) or ``rope_theta`` / ``rope_local_base_freq`` / ``rope_scaling`` (older)."""
    params = dict((hf.get("rope_parameters") or {}).get(layer_type) or {})
    old_theta = hf.get("rope_theta") if layer_type == FULL else hf.get("rope_local_base_freq")
    theta = params.pop("rope_theta", old_theta or GEMMA_THETA[layer_type])
    if not params and layer_type == FULL:
        params = dict(hf.get("rope_scaling") or {})
    return float(theta), _rope_scaling(params)


def _rope_scaling(scaling: dict) -> dict:
    """The scaling dict with its type under 'rope_type' (older configs write 'type')."""
    rope_type = scaling.pop("rope_type", None) or scaling.pop("type", None) or "default"
    scaling.pop("type", None)
    if rope_type not in ROPE_TYPES:
        raise UnsupportedModelError(
            f"unsupported rope scaling type {rope_type!r}; supported: {', '.join(ROPE_TYPES)}"
        )
    scaling["rope_type"] = rope_type
    return scaling


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
    gemma = model_type == "gemma3_text"
    if hf.get("use_sliding_window") and not gemma:
        raise UnsupportedModelError("sliding-window attention (use_sliding_window) is not supported")
    if hf.get("use_bidirectional_attention"):
        raise UnsupportedModelError("bidirectional attention (use_bidirectional_attention) is "
                                    "not supported: targets are causal")
    hidden_act = hf.get("hidden_activation") or hf.get("hidden_act") or (
        "gelu_pytorch_tanh" if gemma else "silu")
    if hidden_act not in HIDDEN_ACTS:
        raise UnsupportedModelError(
            f"unsupported hidden activation {hidden_act!r}; supported: {', '.join(HIDDEN_ACTS)}")
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                "num_attention_heads"):
        if key not in hf:
            raise UnsupportedModelError(f"config.json lacks the field {key!r}")

    heads = int(hf["num_attention_heads"])
    head_dim = int(hf.get("head_dim") or hf["hidden_size"] // heads)
    num_layers = int(hf["num_hidden_layers"])
    if gemma:
        theta, scaling = _gemma_rope_from_hf(hf, FULL)
        local_theta, local_scaling = _gemma_rope_from_hf(hf, SLIDING)
        layer_types = tuple(hf.get("layer_types") or (
            SLIDING if (i + 1) % int(hf.get("sliding_window_pattern") or 6) else FULL
            for i in range(num_layers)))
    else:
        theta, scaling = _rope_from_hf(hf)
        local_theta, local_scaling = theta, scaling
        layer_types = (FULL,) * num_layers
    if len(layer_types) != num_layers or set(layer_types) - {FULL, SLIDING}:
        raise UnsupportedModelError(
            f"layer_types must name {num_layers} layers, each {FULL!r} or {SLIDING!r}; "
            f"got {list(layer_types)}")
    sliding_window = hf.get("sliding_window") if SLIDING in layer_types else None
    if SLIDING in layer_types and not (isinstance(sliding_window, int) and sliding_window > 0):
        raise UnsupportedModelError(f"sliding layers need a positive sliding_window, got "
                                    f"{sliding_window!r}")
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
            head_dim=head_dim,
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=int(hf.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            attention_bias=attention_bias,
            mlp_bias=bool(hf.get("mlp_bias", False)),
            qkv_bias=model_type == "qwen2" or attention_bias,
            o_bias=model_type != "qwen2" and attention_bias,
            qk_norm=model_type in ("qwen3", "gemma3_text"),
            hidden_act=hidden_act,
            norm_offset=1.0 if gemma else 0.0,
            embed_scale=gemma,
            sandwich_norms=gemma,
            query_pre_attn_scalar=(hf.get("query_pre_attn_scalar") or head_dim) if gemma else head_dim,
            final_logit_softcapping=_cap(hf.get("final_logit_softcapping")),
            layer_types=layer_types,
            sliding_window=sliding_window,
            local_rope_theta=local_theta,
            local_rope_scaling=local_scaling,
            bos_token_id=hf.get("bos_token_id"),
            eos_token_id=eos,
            pad_token_id=hf.get("pad_token_id"),
        )
    )


def _cap(value) -> float | None:
    """A soft-capping value: None (or 0) is off."""
    return float(value) if value else None


def _common_hf_fields(cfg: ml_collections.FrozenConfigDict) -> dict:
    """The config.json fields every family writes the same way."""
    return dict(
        architectures=[MODEL_TYPES[cfg.model_type]],
        model_type=cfg.model_type,
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_hidden_layers,
        num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads,
        head_dim=cfg.head_dim,
        rms_norm_eps=cfg.rms_norm_eps,
        max_position_embeddings=cfg.max_position_embeddings,
        tie_word_embeddings=cfg.tie_word_embeddings,
        bos_token_id=cfg.bos_token_id,
        eos_token_id=list(cfg.eos_token_id) if len(cfg.eos_token_id) != 1 else cfg.eos_token_id[0],
        pad_token_id=cfg.pad_token_id,
    )


def model_config_to_hf(cfg: ml_collections.FrozenConfigDict) -> dict:
    """The Hugging Face config.json dict that transformers loads for this model."""
    hf = _common_hf_fields(cfg)
    if cfg.model_type == "gemma3_text":  # transformers >= 5: rope_parameters per layer type
        hf.update(
            hidden_activation=cfg.hidden_act,
            rope_parameters={FULL: dict(cfg.rope_scaling, rope_theta=cfg.rope_theta),
                             SLIDING: dict(cfg.local_rope_scaling, rope_theta=cfg.local_rope_theta)},
            attention_bias=cfg.attention_bias,
            query_pre_attn_scalar=cfg.query_pre_attn_scalar,
            sliding_window=cfg.sliding_window,
            layer_types=list(cfg.layer_types),
            final_logit_softcapping=cfg.final_logit_softcapping)
        return hf
    scaling = dict(cfg.rope_scaling)
    hf.update(hidden_act="silu", rope_theta=cfg.rope_theta,
              rope_scaling=None if scaling.get("rope_type", "default") == "default" else scaling)
    if cfg.model_type != "qwen2":
        hf["attention_bias"] = cfg.attention_bias
    if cfg.model_type == "llama":
        hf["mlp_bias"] = cfg.mlp_bias
    return hf
