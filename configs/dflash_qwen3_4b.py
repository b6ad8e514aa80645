"""The DFlash baseline for Qwen3-4B: the DSpark model without sequential or confidence head
(markov_rank 0), trained with cross-entropy only (DSPARK_SPEC.md section 2)."""

import ml_collections


def get_config() -> ml_collections.ConfigDict:
    config = ml_collections.ConfigDict()
    config.target = "Qwen/Qwen3-4B"
    config.drafter = ml_collections.ConfigDict(dict(
        target_layer_ids=(1, 9, 17, 25, 33), mask_token_id=151669, block_size=7, num_layers=5,
        markov_rank=0, head="none", confidence_head=False, confidence_head_with_markov=False,
        trainable_mask_embedding=False, anchor_predicts=True, num_anchors=512))
    config.train = ml_collections.ConfigDict(dict(
        loss_decay_gamma=4.0, ce_loss_alpha=1.0, l1_loss_alpha=0.0, confidence_head_alpha=0.0,
        learning_rate=6e-4, warmup_ratio=0.04, weight_decay=0.0, grad_clip_norm=1.0,
        global_batch_size=512, epochs=10, max_length=4096))
    return config
