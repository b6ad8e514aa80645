"""The DFlash baseline for Qwen3-4B: the DSpark model without sequential or confidence head
(markov_rank 0), trained with cross-entropy only (DSPARK_SPEC.md section 2).

Target: a local copy of Qwen/Qwen3-4B, required: ``--target=DIR`` (a Hugging Face folder,
e.g. from ``huggingface-cli download Qwen/Qwen3-4B --local-dir DIR``, a .gguf file or an
Orbax folder), with the training data ``--train.data_dir="('DATA',)"``.
"""

from dspark_jax import experiment


def get_config():
    return experiment.qwen3_dflash(target_layer_ids=(1, 9, 17, 25, 33))
