"""DSpark drafter for Gemma4-12B: DeepSpec's reference config (config/dspark/dspark_gemma4_12b.py).

Taps 5, 17, 29, 41, 46 of the target's layers (DSPARK_SPEC.md section 2), 5 draft layers, block
7 (anchor + 6 proposals), vanilla Markov head of rank 256 and the confidence head; mask token 4
(Gemma's <mask>). The draft layers are full-attention layers of the target's full-layer shape
(global_head_dim, num_global_key_value_heads, keys as values), logits soft-capped like the
target's, embeddings scaled by sqrt(hidden_size); DeepSpec's Gemma4DSparkModel layout.

Target: a local copy of google/gemma-4-12B-it, required: ``--target=DIR`` (the Hugging Face
folder as released, a Gemma4UnifiedForConditionalGeneration whose text model dspark-jax loads;
nothing is downloaded), with the training data ``--train.data_dir="('DATA',)"``.
"""

from dspark_jax import experiment


def get_config():
    return experiment.gemma4_dspark(target_layer_ids=(5, 17, 29, 41, 46))
