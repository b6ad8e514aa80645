"""DSpark drafter for Qwen3-4B: DeepSpec's reference config (DSPARK_SPEC.md section 2).

Taps 1, 9, 17, 25, 33 of the 36 target layers (never the last), 5 draft layers, block 7
(anchor + 6 proposals), vanilla Markov head of rank 256 and the confidence head. The mask token
151669 is the first of Qwen3's padded, never-used embedding rows (the tokenizer has 151669
tokens, the embedding 151936 rows).

Target: a local copy of Qwen/Qwen3-4B, required: ``--target=DIR`` (a Hugging Face folder,
e.g. from ``huggingface-cli download Qwen/Qwen3-4B --local-dir DIR``, a .gguf file or an
Orbax folder), with the training data ``--train.data_dir="('DATA',)"``.
"""

from dspark_jax import experiment


def get_config():
    return experiment.qwen3_dspark(target_layer_ids=(1, 9, 17, 25, 33))
