"""The drafter config schema: defaults, validation, and the defaults derived from a target.

A drafter config is an ``ml_collections.FrozenConfigDict`` (hashable, so it can be a static
argument of jitted functions) with these fields (DSPARK_SPEC.md sections 2, 3, 10):

  block_size        B, tokens per draft block: the anchor plus B - 1 mask slots (7).
  num_layers        draft decoder layers (5).
  markov_rank       r, rank of the sequential head; 0 means no head (the DFlash baseline).
  head              "markov" (Eq. 5, DeepSpec "vanilla"), "gated", "rnn" (Eq. 6) or "none".
  target_layer_ids  tapped target layers, strictly increasing, in [-1, L - 2] (-1 = the
                    embedding output; the last layer is never tapped).
  mask_token_id     the target embedding row used for mask slots (or, with
                    ``trainable_mask_embedding``, only the id written into exported configs).
  trainable_mask_embedding  the drafter owns a trained mask vector [d] instead of using the
                    target's row ``mask_token_id`` (for vocabularies without a spare row).
  confidence_head   whether the drafter has the confidence head (Eq. 7).
  confidence_head_with_markov  its input is [h_k; W1[prev_k]] (True) or h_k alone.
  anchor_predicts   slot 0 (the anchor) predicts the next token, so slot k predicts position
                    anchor + k + 1 and all B slots are proposals (DeepSpec); False: slot k
                    predicts position anchor + k and only the B - 1 mask slots are proposals
                    (z-lab DFlash checkpoints).

Training settings (anchors per sequence, loss weights, ...) are not part of it: they are the
experiment's ``train`` config (``dspark_jax.experiment``).

The DFlash baseline is the config ``markov_rank=0, head="none", confidence_head=False``.
"""

from __future__ import annotations

from typing import Any

import ml_collections

HEADS = ("markov", "gated", "rnn", "none")
# Our head names <-> DeepSpec's ``markov_head_type``.
DEEPSPEC_HEAD_TYPES = {"markov": "vanilla", "gated": "gated", "rnn": "rnn"}

DEFAULTS: dict[str, Any] = dict(
    block_size=7,
    num_layers=5,
    markov_rank=256,
    head="markov",
    target_layer_ids=None,
    mask_token_id=None,
    trainable_mask_embedding=False,
    confidence_head=True,
    confidence_head_with_markov=True,
    anchor_predicts=True,
)
FIELDS = tuple(DEFAULTS)


def drafter_config(**fields) -> ml_collections.FrozenConfigDict:
    """A validated drafter config; unspecified fields take ``DEFAULTS``.

    ``head="none"`` forces ``markov_rank=0``; ``markov_rank=0`` gives ``head="none"`` unless a
    head is named explicitly (an error). A confidence head without a Markov head reads h_k alone.

    Raises:
      ValueError: unknown field, or a value out of range (message names the field).
    """
    unknown = sorted(set(fields) - set(FIELDS))
    if unknown:
        raise ValueError(f"unknown drafter config field(s) {', '.join(unknown)}; "
                         f"known: {', '.join(FIELDS)}")
    cfg = {**DEFAULTS, **{k: v for k, v in fields.items() if v is not None}}
    if cfg["head"] not in HEADS:
        raise ValueError(f"unknown head {cfg['head']!r}; choose one of {', '.join(HEADS)}")
    if cfg["head"] == "none":
        cfg["markov_rank"] = 0
    elif int(cfg["markov_rank"]) == 0:
        if "head" in fields:
            raise ValueError(f"head {cfg['head']!r} needs markov_rank > 0")
        cfg["head"] = "none"
    if cfg["head"] == "none":
        cfg["confidence_head_with_markov"] = False
    for key, low in (("block_size", 2), ("num_layers", 1), ("markov_rank", 0)):
        if int(cfg[key]) < low:
            raise ValueError(f"{key} must be >= {low}, got {cfg[key]}")
        cfg[key] = int(cfg[key])
    if cfg["target_layer_ids"] is None:
        raise ValueError("target_layer_ids is required")
    ids = tuple(int(i) for i in cfg["target_layer_ids"])
    if not ids or any(b <= a for a, b in zip(ids, ids[1:])) or ids[0] < -1:
        raise ValueError(f"target_layer_ids must be non-empty, strictly increasing and >= -1, got {ids}")
    cfg["target_layer_ids"] = ids
    if cfg["mask_token_id"] is None:
        raise ValueError("mask_token_id is required")
    cfg["mask_token_id"] = int(cfg["mask_token_id"])
    for key in ("trainable_mask_embedding", "confidence_head", "confidence_head_with_markov",
                "anchor_predicts"):
        cfg[key] = bool(cfg[key])
    return ml_collections.FrozenConfigDict(cfg)


def check_fit(cfg, target_config, *, error=ValueError) -> None:
    """Raises ``error`` when a drafter config cannot run on a target (vocabulary, layer ids)."""
    num_layers, vocab = target_config.num_hidden_layers, target_config.vocab_size
    bad = [i for i in cfg.target_layer_ids if not -1 <= i <= num_layers - 2]
    if bad:
        raise error(
            f"target_layer_ids {list(cfg.target_layer_ids)} out of range for a target with "
            f"{num_layers} layers: ids must be in [-1, {num_layers - 2}] (the last layer is never "
            f"tapped); offending: {bad}")
    if not 0 <= cfg.mask_token_id < vocab:
        raise error(f"mask_token_id {cfg.mask_token_id} is outside the target vocabulary of size {vocab}")


def default_layer_ids(num_target_layers: int, max_taps: int = 5) -> tuple[int, ...]:
    """Up to ``max_taps`` layer ids spread evenly, never the last layer.

    For deep targets the span is [1, L - 3], which gives DeepSpec's reference taps
    (36 layers: 1, 9, 17, 25, 33; 40 layers: 1, 10, 19, 28, 37); shallow targets use [0, L - 2].
    """
    if num_target_layers < 2:
        raise ValueError(f"a target needs at least 2 layers to be tapped, got {num_target_layers}")
    low, high = (1, num_target_layers - 3) if num_target_layers >= 6 else (0, num_target_layers - 2)
    count = min(max_taps, high - low + 1)
    if count == 1:
        return (low,)
    return tuple(low + int(i * (high - low) / (count - 1) + 0.5) for i in range(count))


def spare_vocab_row(target_config, tokenizer) -> int | None:
    """The first embedding row no token uses (``len(tokenizer) < vocab_size``), else None.

    Qwen3 pads its 151669 tokens to 151936 rows, so this gives DeepSpec's mask id 151669.
    Without a tokenizer nothing is known to be spare.
    """
    if tokenizer is None:
        return None
    used = len(tokenizer)
    return used if used < target_config.vocab_size else None


def default_drafter_config(target_config, tokenizer=None, **overrides) -> ml_collections.FrozenConfigDict:
    """A drafter config derived from a target config (and its tokenizer), with overrides.

    Taps from :func:`default_layer_ids`; ``min(5, L // 2)`` draft layers; rank ``min(256, d)``;
    the mask is the spare row from :func:`spare_vocab_row` when there is one, otherwise a
    trainable mask embedding (nominal id: the last row, a rare token in BPE vocabularies;
    it is only written into exported checkpoints).
    """
    fields = dict(
        target_layer_ids=default_layer_ids(target_config.num_hidden_layers),
        num_layers=min(5, max(1, target_config.num_hidden_layers // 2)),
        markov_rank=min(256, target_config.hidden_size),
    )
    if "mask_token_id" in overrides and overrides["mask_token_id"] is not None:
        fields["trainable_mask_embedding"] = False
    else:
        spare = spare_vocab_row(target_config, tokenizer)
        if spare is None:
            fields["mask_token_id"] = target_config.vocab_size - 1
            fields["trainable_mask_embedding"] = True
        else:
            fields["mask_token_id"] = spare
    fields.update({k: v for k, v in overrides.items() if v is not None})
    return drafter_config(**fields)
