"""The DFlash baseline for Qwen3-4B: the DSpark model without sequential or confidence head
(markov_rank 0), trained with cross-entropy only (DSPARK_SPEC.md section 2)."""

from dspark_jax import presets


def get_config():
    return presets.qwen3_dflash("Qwen/Qwen3-4B", target_layer_ids=(1, 9, 17, 25, 33))
