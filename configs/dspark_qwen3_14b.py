"""DSpark drafter for Qwen3-14B (40 layers): taps 1, 10, 19, 28, 37, DSPARK_SPEC.md section 2."""

from dspark_jax import presets


def get_config():
    return presets.qwen3_dspark("Qwen/Qwen3-14B", target_layer_ids=(1, 10, 19, 28, 37))
