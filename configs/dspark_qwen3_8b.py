"""DSpark drafter for Qwen3-8B: same taps as Qwen3-4B (both have 36 layers), DSPARK_SPEC.md section 2.

Target: a local copy of Qwen/Qwen3-8B, required: ``--target=DIR`` (a Hugging Face folder,
e.g. from ``huggingface-cli download Qwen/Qwen3-8B --local-dir DIR``, a .gguf file or an
Orbax folder), with the training data ``--train.data_dir="('DATA',)"``.
"""

from dspark_jax import experiment


def get_config():
    return experiment.qwen3_dspark(target_layer_ids=(1, 9, 17, 25, 33))
