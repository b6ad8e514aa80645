"""DSpark drafter for Qwen3-8B: same taps as Qwen3-4B (both have 36 layers), DSPARK_SPEC.md section 2."""

from dspark_jax import presets


def get_config():
    return presets.qwen3_dspark("Qwen/Qwen3-8B", target_layer_ids=(1, 9, 17, 25, 33))
