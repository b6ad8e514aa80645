"""Model configuration: Hugging Face ``config.json`` <-> one frozen ml-collections schema.

The target decoder family (Llama, Qwen2, Qwen3, Gemma3, Gemma4) is described by a single
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
* Gemma4's (dense text models): plain-weight norms (``norm_offset`` 0), values RMS-normed without
  a scale (``v_norm``), a ``layer_scalar`` [1] multiplying each layer's output, scores unscaled
  (``query_pre_attn_scalar`` 1), and full-attention layers of their own shape:
  ``global_head_dim``, ``num_global_key_value_heads`` and ``attention_k_eq_v`` (the values are
  the keys' projection), with a "proportional" partial rope. Elsewhere the global fields equal
  the plain ones; :func:`attention_dims` gives a layer type's, :func:`layer_groups` the layers
  that share one parameter shape.

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
    "Gemma4ForCausalLM": "gemma4_text",
    "Gemma4UnifiedForCausalLM": "gemma4_unified_text",  # the 12B: Gemma4's dense layers, no PLE
}
# Multimodal checkpoints whose text model runs here: config.json nests it in ``text_config``
# (:func:`text_model_hf`).
MULTIMODAL = {"Gemma3ForConditionalGeneration": "Gemma3ForCausalLM",
              "Gemma4ForConditionalGeneration": "Gemma4ForCausalLM",
              "Gemma4UnifiedForConditionalGeneration": "Gemma4UnifiedForCausalLM"}
MODEL_TYPES = {v: k for k, v in ARCHITECTURES.items()}
ROPE_TYPES = ("default", "linear", "llama3", "yarn", "proportional")
GEMMA4_TYPES = ("gemma4_text", "gemma4_unified_text")
GEMMA_FAMILY = ("gemma3_text",) + GEMMA4_TYPES
HIDDEN_ACTS = ("silu", "gelu_pytorch_tanh")
FULL, SLIDING = "full_attention", "sliding_attention"
GEMMA_THETA = {FULL: 1_000_000.0, SLIDING: 10_000.0}  # transformers' Gemma3 defaults
# transformers' Gemma4 defaults for what a config.json leaves out.
GEMMA4_ROPE = {FULL: {"rope_type": "proportional", "partial_rotary_factor": 0.25},
               SLIDING: {"rope_type": "default"}}
GEMMA4_GLOBAL_HEAD_DIM = 512
GEMMA4_PER_LAYER_INPUT = 256  # hidden_size_per_layer_input: per-layer embeddings (PLE)


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


def _gemma_rope_from_hf(hf: Mapping[str, Any], layer_type: str, model_type: str
                        ) -> tuple[float, dict]:
    """(rope_theta, scaling) of one Gemma3 / Gemma4 layer type, from ``rope_parameters[layer_type]``
    (transformers >= 5) or ``rope_theta`` / ``rope_local_base_freq`` / ``rope_scaling`` (older
    Gemma3)."""
    params = dict((hf.get("rope_parameters") or {}).get(layer_type) or {})
    if not params and model_type in GEMMA4_TYPES:
        params = dict(GEMMA4_ROPE[layer_type])
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
    gemma = model_type in GEMMA_FAMILY
    gemma4 = model_type in GEMMA4_TYPES
    if gemma4:
        _check_gemma4_dense(hf, model_type)
    if hf.get("use_sliding_window") and not gemma:
        raise UnsupportedModelError("sliding-window attention (use_sliding_window) is not supported")
    bidirectional = hf.get("use_bidirectional_attention")
    if bidirectional and not (gemma4 and bidirectional == "vision"):  # "vision": text is causal
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
        theta, scaling = _gemma_rope_from_hf(hf, FULL, model_type)
        local_theta, local_scaling = _gemma_rope_from_hf(hf, SLIDING, model_type)
        layer_types = tuple(hf.get("layer_types") or (
            SLIDING if (i + 1) % int(hf.get("sliding_window_pattern") or 6) else FULL
            for i in range(num_layers)))
        if gemma4 and layer_types:  # transformers forces the last Gemma4 layer to full attention
            layer_types = layer_types[:-1] + (FULL,)
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
    kv_heads = int(hf.get("num_key_value_heads") or heads)
    global_kv_heads, global_head_dim, k_eq_v = ((kv_heads, head_dim, False) if not gemma4 else
                                                _gemma4_global_dims(hf, layer_types, kv_heads, head_dim))
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
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            num_global_key_value_heads=global_kv_heads,
            global_head_dim=global_head_dim,
            attention_k_eq_v=k_eq_v,
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=int(hf.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", gemma4)),
            attention_bias=attention_bias,
            mlp_bias=bool(hf.get("mlp_bias", False)),
            qkv_bias=model_type == "qwen2" or attention_bias,
            o_bias=model_type != "qwen2" and attention_bias,
            qk_norm=model_type in ("qwen3",) + GEMMA_FAMILY,
            v_norm=gemma4,
            layer_scalar=gemma4,
            hidden_act=hidden_act,
            norm_offset=1.0 if gemma and not gemma4 else 0.0,
            embed_scale=gemma,
            sandwich_norms=gemma,
            query_pre_attn_scalar=(1.0 if gemma4 else (hf.get("query_pre_attn_scalar") or head_dim)
                                   if gemma else head_dim),
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


def _check_gemma4_dense(hf: Mapping[str, Any], model_type: str) -> None:
    """Raises UnsupportedModelError for the Gemma4 options of the small and MoE models."""
    ple_default = GEMMA4_PER_LAYER_INPUT if model_type == "gemma4_text" else 0
    if int(hf.get("hidden_size_per_layer_input", ple_default) or 0):
        raise UnsupportedModelError("Gemma4 per-layer embeddings (hidden_size_per_layer_input > 0, "
                                    "the E2B / E4B models) are not supported; dense text models only")
    if int(hf.get("num_kv_shared_layers") or 0):
        raise UnsupportedModelError("Gemma4 KV sharing across layers (num_kv_shared_layers > 0) is "
                                    "not supported")
    if hf.get("enable_moe_block"):
        raise UnsupportedModelError("Gemma4 mixture-of-experts blocks (enable_moe_block) are not "
                                    "supported; dense text models only")


def _gemma4_global_dims(hf: Mapping[str, Any], layer_types, kv_heads: int, head_dim: int
                        ) -> tuple[int, int, bool]:
    """(kv heads, head dim, k_eq_v) of Gemma4's full-attention layers, from ``global_head_dim`` /
    ``num_global_key_value_heads`` (the released configs) or ``per_layer_config`` (what
    transformers 5.24 writes), as Gemma4TextConfig resolves them."""
    k_eq_v = bool(hf.get("attention_k_eq_v", False))
    if hf.get("per_layer_config") is not None:  # the overrides, {} where none differs
        per_layer = {int(i): dict(v) for i, v in hf["per_layer_config"].items()}
        full = {i for i, t in enumerate(layer_types) if t == FULL}
        overrides = {tuple(sorted(per_layer.get(i, {}).items())) for i in full}
        if set(per_layer) - full or len(overrides) > 1:
            raise UnsupportedModelError(
                "per_layer_config must give every full-attention layer the same head_dim / "
                f"num_key_value_heads and no sliding layer any; got {hf['per_layer_config']}")
        shape = dict(overrides.pop()) if overrides else {}
        return (int(shape.get("num_key_value_heads", kv_heads)),
                int(shape.get("head_dim", head_dim)), k_eq_v)
    global_kv = hf.get("num_global_key_value_heads") if k_eq_v else None
    return (int(global_kv or kv_heads), int(hf.get("global_head_dim") or GEMMA4_GLOBAL_HEAD_DIM),
            k_eq_v)


def attention_dims(cfg, layer_type: str = FULL) -> tuple[int, int, bool]:
    """(kv heads, head dim, k_eq_v) of a layer type's attention: Gemma4's full layers have their
    own; every other layer has ``num_key_value_heads`` and ``head_dim`` and its own values."""
    if layer_type == FULL:
        return cfg.num_global_key_value_heads, cfg.global_head_dim, cfg.attention_k_eq_v
    return cfg.num_key_value_heads, cfg.head_dim, False


def layer_groups(cfg) -> tuple[tuple[int, ...], ...]:
    """The layer ids of each group of layers with one parameter shape, in order: every layer in
    one group, or (sliding, full) when the two types' :func:`attention_dims` differ (Gemma4)."""
    ids = range(cfg.num_hidden_layers)
    types = cfg.layer_types
    if SLIDING not in types or FULL not in types or (
            attention_dims(cfg, FULL) == attention_dims(cfg, SLIDING)):
        return (tuple(ids),)
    return tuple(tuple(i for i in ids if types[i] == t) for t in (SLIDING, FULL))


def text_model_hf(hf: Mapping[str, Any]) -> dict | None:
    """The text model's config.json dict of a multimodal Gemma checkpoint (``MULTIMODAL``), with
    its causal-LM architecture and the token ids and embedding tie the top level holds; None
    for any other config."""
    archs = list(hf.get("architectures") or [])
    if not archs or archs[0] not in MULTIMODAL:
        return None
    text = dict(hf.get("text_config") or {})
    if not text:
        raise UnsupportedModelError(f"the {archs[0]} config.json has no text_config")
    text["architectures"] = [MULTIMODAL[archs[0]]]
    text["model_type"] = ARCHITECTURES[MULTIMODAL[archs[0]]]
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if text.get(key) is None and hf.get(key) is not None:
            text[key] = hf[key]
    if "tie_word_embeddings" in hf:  # the multimodal model ties its LM head by the top level
        text["tie_word_embeddings"] = hf["tie_word_embeddings"]
    return text


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
    if cfg.model_type in GEMMA_FAMILY:  # transformers >= 5: rope_parameters per layer type
        hf.update(
            hidden_activation=cfg.hidden_act,
            rope_parameters={FULL: dict(cfg.rope_scaling, rope_theta=cfg.rope_theta),
                             SLIDING: dict(cfg.local_rope_scaling, rope_theta=cfg.local_rope_theta)},
            attention_bias=cfg.attention_bias,
            sliding_window=cfg.sliding_window,
            layer_types=list(cfg.layer_types),
            final_logit_softcapping=cfg.final_logit_softcapping)
        if cfg.model_type == "gemma3_text":
            hf["query_pre_attn_scalar"] = cfg.query_pre_attn_scalar
        else:
            hf.update(global_head_dim=cfg.global_head_dim,
                      num_global_key_value_heads=cfg.num_global_key_value_heads,
                      attention_k_eq_v=cfg.attention_k_eq_v, num_kv_shared_layers=0)
            if cfg.model_type == "gemma4_text":  # the unified config has neither field
                hf.update(hidden_size_per_layer_input=0, enable_moe_block=False)
        return hf
    scaling = dict(cfg.rope_scaling)
    hf.update(hidden_act="silu", rope_theta=cfg.rope_theta,
              rope_scaling=None if scaling.get("rope_type", "default") == "default" else scaling)
    if cfg.model_type != "qwen2":
        hf["attention_bias"] = cfg.attention_bias
    if cfg.model_type == "llama":
        hf["mlp_bias"] = cfg.mlp_bias
    return hf
