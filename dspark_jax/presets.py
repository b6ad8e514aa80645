"""The DeepSpec reference settings (DSPARK_SPEC.md section 2) that configs/*.py build on.

A config file is ``get_config()`` returning an ml-collections ConfigDict with ``.target`` (a
model name or path), ``.drafter`` (drafter config fields) and ``.train`` (training settings).
The Qwen3 configs leave ``.target`` unset (None): it is the user's local copy of the model,
required on the command line (``--target=PATH``, checked by
``dspark_jax.experiment.check_runnable``), as is ``train.data_dir`` in every config.
"""

from __future__ import annotations

import ml_collections

# Qwen3 drafters: 5 draft layers, block 7 (anchor + 6), vanilla Markov head of rank 256, the
# confidence head, mask token 151669 (Qwen3's first padded embedding row).
QWEN3_DSPARK_DRAFTER = dict(
    mask_token_id=151669, block_size=7, num_layers=5, markov_rank=256, head="markov",
    confidence_head=True, confidence_head_with_markov=True, trainable_mask_embedding=False,
    anchor_predicts=True, num_anchors=512)
# The DFlash baseline is the same model without sequential or confidence head.
DFLASH_DRAFTER_CHANGES = dict(markov_rank=0, head="none", confidence_head=False,
                              confidence_head_with_markov=False)

# The recipe fields (dspark_jax/training/recipe.py) at the reference's values: N(0, 0.02) Markov
# factors, draft layers from init, one learning rate for every parameter.
RECIPE_REFERENCE = dict(markov_init="reference", markov_w1_scale=1.0, markov_scale=1.0,
                        bigram_smoothing=1.0, draft_layers_from=(), lr_multipliers=())

DSPARK_TRAIN = dict(
    RECIPE_REFERENCE,
    loss_decay_gamma=4.0, ce_loss_alpha=0.1, l1_loss_alpha=0.9, confidence_head_alpha=1.0,
    learning_rate=6e-4, warmup_ratio=0.04, weight_decay=0.0, grad_clip_norm=1.0,
    global_batch_size=512, epochs=10, max_length=4096,
    # dspark-jax's own settings (the trainer, dspark_jax/training/trainer.py):
    data_dir=(),            # folders written by `dspark-jax prepare-data`
    feature_dir=(),         # optional target-feature caches (`dspark-jax prepare-features`),
                            # one per data_dir; empty: the step runs the target online
    max_steps=0,            # 0: epochs x the packed batches of one pass over the data
                            # (trainer.total_steps)
    pack_length=4096,       # tokens per packed row
    anchors_per_row=512,    # anchor slots per packed row
    grad_accum_steps=1,
    anchor_chunk=32,        # anchors per chunk of full-vocabulary logits
    mesh_shape=(-1, 1, 1),  # (data, fsdp, tensor)
    seed=0,
    init_from="",           # a saved drafter to start from (a warm start: new optimizer and
                            # schedule); "": init_drafter and the recipe's initialisation
    log_every=10,
    checkpoint_every=500,
    keep_checkpoints=3,
    heldout_dir=(),         # held-out prepare-data folders for the learning curve (heldout.jsonl)
    heldout_feature_dir=(), # their feature caches (optional, one per heldout_dir): a cheap curve
    heldout_every=0,        # evaluate every this many steps (0: only at step 0 and at the end)
    heldout_batches=0)      # batches of the held-out epoch to use (0: all)
# DFlash trains with cross-entropy only.
DFLASH_TRAIN_CHANGES = dict(ce_loss_alpha=1.0, l1_loss_alpha=0.0, confidence_head_alpha=0.0)

# The embedded default target SmolLM2-135M-Instruct, sized to train on a CPU (see
# configs/dspark_smollm2_135m.py for the reasoning behind each number).
SMOLLM2_DRAFTER = dict(
    target_layer_ids=(1, 8, 14, 21, 27), mask_token_id=49151, block_size=7, num_layers=2,
    markov_rank=32, head="markov", confidence_head=True, confidence_head_with_markov=True,
    trainable_mask_embedding=True, anchor_predicts=True, num_anchors=64)
SMOLLM2_TRAIN = dict(
    DSPARK_TRAIN, learning_rate=1e-3, global_batch_size=4, epochs=1, max_length=512,
    max_steps=150, pack_length=512, anchors_per_row=64, anchor_chunk=16, log_every=5,
    checkpoint_every=50)


def experiment(target: str | None, drafter: dict, train: dict) -> ml_collections.ConfigDict:
    """An experiment config: ``.target`` (None: a required string field), ``.drafter`` and
    ``.train``."""
    config = ml_collections.ConfigDict()
    config.target = ml_collections.config_dict.placeholder(str) if target is None else target
    config.drafter = ml_collections.ConfigDict(dict(drafter))
    config.train = ml_collections.ConfigDict(dict(train))
    return config


def qwen3_dspark(target_layer_ids: tuple[int, ...]) -> ml_collections.ConfigDict:
    """DeepSpec's DSpark config for a Qwen3 target (``.target``: required, the local copy)."""
    return experiment(None, dict(QWEN3_DSPARK_DRAFTER, target_layer_ids=target_layer_ids),
                      DSPARK_TRAIN)


def smollm2_dspark() -> ml_collections.ConfigDict:
    """The DSpark drafter of the embedded default target."""
    return experiment("smollm2-135m-instruct", SMOLLM2_DRAFTER, SMOLLM2_TRAIN)


def smollm2_dflash() -> ml_collections.ConfigDict:
    """The DFlash baseline of the embedded default target: same data, budget and backbone."""
    return experiment("smollm2-135m-instruct", dict(SMOLLM2_DRAFTER, **DFLASH_DRAFTER_CHANGES),
                      dict(SMOLLM2_TRAIN, **DFLASH_TRAIN_CHANGES))


def qwen3_dflash(target_layer_ids: tuple[int, ...]) -> ml_collections.ConfigDict:
    """DeepSpec's DFlash baseline config for a Qwen3 target (``.target``: required)."""
    return experiment(
        None, dict(QWEN3_DSPARK_DRAFTER, target_layer_ids=target_layer_ids, **DFLASH_DRAFTER_CHANGES),
        dict(DSPARK_TRAIN, **DFLASH_TRAIN_CHANGES))
